"""The HTTP router's cost: prints one JSON line per measurement.

    python benchmarks/bench_pool.py --model qwen3-0.6b --max-total-tokens 300000
    python benchmarks/bench_pool.py --model /tmp/rollout-tiny --num-seqs 8 --max-len 120 \\
        --max-total-tokens 4096 -- --dtype float32

Two runs of the nano workload (bench_offline.py's), each request its own HTTP /generate from
--concurrency client threads:
- direct: one `rollout serve` worker, the requests sent to it;
- pool: --workers `rollout serve` workers (sharing the device: give each --max-total-tokens, since
  mem_fraction counts the whole GPU) behind `rollout router`, the requests sent to the router.
  With --one-gpu-each, worker i runs on GPU i and the direct run is one such worker on GPU 0
  (the scaling of replicas over GPUs).
Output tok/s of both and their ratio. The router's overhead per request: over --probes rounds
of one-token requests (a short prompt, the same to each worker directly and then to the
router), the median of each routed request's time minus the direct time of the worker that
answered it (probe_ms). Arguments after `--` go to every `rollout serve`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_offline import nano_workload  # noqa: E402
from rollout.real_configs import REAL_CONFIGS, write_config_checkpoint  # noqa: E402

BASE_PORT = 31000
PROBE_WARMUP = 10  # rounds of probes not counted


def start(args: list[str], port: int, log_dir: str) -> subprocess.Popen:
    log = open(os.path.join(log_dir, f"{port}.log"), "w")
    cmd = [sys.executable, "-m", "rollout.cli", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log.name  # what wait_healthy shows of a server that exits
    return proc


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(proc.log_path) as log:
                tail = "".join(log.readlines()[-30:])
            raise RuntimeError(f"the server on port {port} exited with {proc.returncode}:\n{tail}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server on port {port} did not answer /health in {timeout} s")


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def generate(port: int, ids: list[int], params: dict) -> int:
    body = {"input_ids": ids, "sampling_params": params}
    reply = requests.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=3600)
    reply.raise_for_status()
    return len(reply.json()["output_ids"])


def throughput(port: int, workload, concurrency: int) -> tuple[float, int]:
    prompts, params = workload
    start_t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(lambda job: generate(port, *job), zip(prompts, params)))
    return time.perf_counter() - start_t, tokens


def probe_ms(worker_ports: list[int], router_port: int, count: int) -> dict:
    """`count` rounds of one-token requests, each round one to every worker and then one to the
    router, so that the machine's load changing weighs on all alike. The router names the
    worker that answered (x-rollout-replica): its overhead is the median over rounds of the
    routed request's time minus that worker's direct time in the same round. Workers sharing
    a GPU differ by more than the router adds (RESULTS.md, twenty-third session): a difference
    of medians mixes that in."""
    params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    direct: list[list[float]] = [[] for _ in worker_ports]
    routed, paired = [], []
    for i in range(-PROBE_WARMUP, count):
        body = {"input_ids": [1 + i % 50, 2, 3, 4], "sampling_params": params}
        times = []
        for port in worker_ports:
            start_t = time.perf_counter()
            requests.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60).raise_for_status()
            times.append(time.perf_counter() - start_t)
        start_t = time.perf_counter()
        reply = requests.post(f"http://127.0.0.1:{router_port}/generate", json=body, timeout=60)
        reply.raise_for_status()
        through = time.perf_counter() - start_t
        if i >= 0:
            for kept, t in zip(direct, times):
                kept.append(t)
            routed.append(through)
            paired.append(through - times[int(reply.headers["x-rollout-replica"])])
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3)  # noqa: E731
    return {
        "probe_workers_ms": [ms(kept) for kept in direct],
        "probe_router_ms": ms(routed),
        "router_overhead_ms": ms(paired),
        # The estimate before the header: the routed median minus the mean of the workers'.
        "router_overhead_unpaired_ms": round(ms(routed) - statistics.mean(ms(k) for k in direct), 3),
    }


def run_direct(serve: list[str], workload, args, log_dir: str) -> dict:
    # Sharing one device, the direct worker gets the pool's whole KV; one GPU each, one worker's.
    tokens = args.max_total_tokens * (1 if args.one_gpu_each else args.workers)
    proc = start(serve + ["--max-total-tokens", str(tokens)], BASE_PORT, log_dir)
    try:
        wait_healthy(BASE_PORT, proc)
        throughput(BASE_PORT, (workload[0][:8], workload[1][:8]), args.concurrency)  # warm up
        seconds, tokens = throughput(BASE_PORT, workload, args.concurrency)
        return {"seconds": round(seconds, 3), "tok_per_s": round(tokens / seconds, 1)}
    finally:
        stop([proc])


def run_pool(serve: list[str], model_path: str, workload, args, log_dir: str) -> dict:
    ports = [BASE_PORT + 1 + i for i in range(args.workers)]
    workers = []
    for i, port in enumerate(ports):
        placed = ["--base-gpu-id", str(i)] if args.one_gpu_each else []
        workers.append(start(serve + ["--max-total-tokens", str(args.max_total_tokens), *placed], port, log_dir))
    procs = list(workers)
    try:
        for port, proc in zip(ports, workers):
            wait_healthy(port, proc)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        router = start(["router", "--worker-urls", *urls, "--model-path", model_path], BASE_PORT, log_dir)
        procs.append(router)
        wait_healthy(BASE_PORT, router)
        throughput(BASE_PORT, (workload[0][:8], workload[1][:8]), args.concurrency)
        seconds, tokens = throughput(BASE_PORT, workload, args.concurrency)
        return {
            "seconds": round(seconds, 3), "tok_per_s": round(tokens / seconds, 1),
            **probe_ms(ports, BASE_PORT, args.probes),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        }
    finally:
        stop(procs)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", help=f"a checkpoint directory or one of {sorted(REAL_CONFIGS)}")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-total-tokens", type=int, required=True, help="KV tokens of each pool worker")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--probes", type=int, default=200)
    parser.add_argument("--one-gpu-each", action="store_true", help="worker i on GPU i (--base-gpu-id)")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    model_path, serve = args.model, ["serve"]
    if model_path in REAL_CONFIGS:
        model_path = write_config_checkpoint(model_path, tempfile.mkdtemp(prefix=f"rollout-{args.model}-"))
        serve += ["--load-format", "dummy"]
    serve += ["--model-path", model_path, *extra]
    with open(os.path.join(model_path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    workload = nano_workload(args.num_seqs, args.max_len, vocab)
    log_dir = tempfile.mkdtemp(prefix="rollout-bench-pool-")
    direct = run_direct(serve, workload, args, log_dir)
    pool = run_pool(serve, model_path, workload, args, log_dir)
    print(json.dumps({
        "bench": "pool", "workers": args.workers, "one_gpu_each": args.one_gpu_each, "direct": direct, "pool": pool,
        "ratio": round(pool["tok_per_s"] / direct["tok_per_s"], 3), "logs": log_dir,
    }), flush=True)


if __name__ == "__main__":
    main()
