"""What `rollout router` adds to one request: sequential one-token /generate requests sent in
turn to a `rollout serve` worker and to a router in front of it (issue 21: ≤ 1 ms median).

    python benchmarks/bench_router_overhead.py                    # a tiny checkpoint, CPU
    python benchmarks/bench_router_overhead.py --model-path CKPT --requests 400 -- --dtype float32

The worker runs float32 on the CPU unless arguments after `--` (given to `rollout serve`) say
otherwise. Each side has its own requests.Session (one kept connection); a request's time
includes reading its JSON answer. Prints the median of each side and their difference (ms).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_ARGS = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "8192"]
WARMUP = 20  # requests to each side not counted


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_ms(session: requests.Session, url: str, i: int) -> float:
    body = {
        "input_ids": [1 + i % 50, 2, 3, 4],
        "sampling_params": {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True},
    }
    start_t = time.perf_counter()
    reply = session.post(f"{url}/generate", json=body, timeout=60)
    reply.raise_for_status()
    assert len(reply.json()["output_ids"]) == 1
    return (time.perf_counter() - start_t) * 1e3


def measure(direct_url: str, router_url: str, count: int) -> tuple[list[float], list[float]]:
    """`count` requests to each side, one to each in turn, so that the machine's load changing
    weighs on both alike."""
    direct, routed = [], []
    with requests.Session() as to_worker, requests.Session() as to_router:
        for i in range(-WARMUP, count):
            d = request_ms(to_worker, direct_url, i)
            r = request_ms(to_router, router_url, i)
            if i >= 0:
                direct.append(d)
                routed.append(r)
    return direct, routed


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", help="a checkpoint; default: a tiny one made here")
    parser.add_argument("--requests", type=int, default=400, help="counted requests per side")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    sys.path.insert(0, REPO)
    from benchmarks.bench_pool import start, stop, wait_healthy
    from rollout.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        model_path = args.model_path or make_tiny_model(os.path.join(tmp, "tiny"), "qwen3", seed=2)
        worker_port, router_port = free_port(), free_port()
        worker_url = f"http://127.0.0.1:{worker_port}"
        router_url = f"http://127.0.0.1:{router_port}"
        procs = []
        try:
            serve = ["serve", "--model-path", model_path, *WORKER_ARGS, *extra]
            procs.append(start(serve, worker_port, tmp))
            wait_healthy(worker_port, procs[-1])
            procs.append(start(["router", "--worker-urls", worker_url], router_port, tmp))
            wait_healthy(router_port, procs[-1])
            direct, routed = measure(worker_url, router_url, args.requests)
        except BaseException:
            for name in sorted(os.listdir(tmp)):
                if name.endswith(".log"):
                    with open(os.path.join(tmp, name)) as f:
                        print(f"--- {name}\n{f.read()[-4000:]}", file=sys.stderr)
            raise
        finally:
            stop(procs)
    d, r = statistics.median(direct), statistics.median(routed)
    print(f"requests per side: {args.requests}, load average (1 min): {os.getloadavg()[0]:.2f}")
    print(f"median direct: {d:.3f} ms")
    print(f"median router: {r:.3f} ms")
    print(f"overhead:      {r - d:.3f} ms")


if __name__ == "__main__":
    main()
