"""How long one short request takes, layer by layer: the latency an agentic turn pays before
its first token. Sequential requests of `--prompt-len` tokens and `--new-tokens` output, each
with a prompt not seen before (no prefix hit), timed

  scheduler  in-process: the Scheduler's add_request, then step() until it finishes (the model's
             forwards and the scheduler's host work only);
  engine     RolloutEngine.generate (tokenizer manager → scheduler process → back, over ZMQ);
  http       `rollout serve`'s /generate from a kept connection (uvicorn, JSON).

    python benchmarks/bench_turn_latency.py --model qwen3-0.6b
    python benchmarks/bench_turn_latency.py --model qwen3-0.6b --prompt-len 512 --profile
    python benchmarks/bench_turn_latency.py --device cpu        # a tiny checkpoint, float32

Prints one JSON line of medians (ms). With --profile it also prints, for the in-process layer,
the Python functions taking the host's time (cProfile) and the kernels of one request with the
device's busy time (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import requests  # noqa: E402
import torch  # noqa: E402

from rollout.real_configs import REAL_CONFIGS, write_config_checkpoint  # noqa: E402

WARMUP = 10  # requests per layer not counted


VOCAB = 800  # prompt ids below this: the tiny checkpoints' vocabularies hold them


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """Random prompts, each a new one: a prefix hit longer than a token or two is unlikely."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(count)]


def median_ms(run, ids_list: list[list[int]]) -> float:
    times = []
    for i, ids in enumerate(ids_list):
        start = time.perf_counter()
        run(ids)
        if i >= WARMUP:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def scheduler_layer(options: dict, args, params: dict) -> tuple[float, object]:
    from rollout.config import EngineOptions
    from rollout.engine.heap import startup_heap_frozen
    from rollout.engine.messages import TokenizedRequest
    from rollout.engine.sampling_params import SamplingParams
    from rollout.engine.scheduler_process import SchedulerProcess

    start = time.perf_counter()
    proc = SchedulerProcess(EngineOptions.from_kwargs(**options))
    proc.warm_up()
    proc.startup_s = time.perf_counter() - start
    sched, count = proc.scheduler, [0]
    cuda = proc.runner.device.type == "cuda"

    def run(ids: list[int]) -> None:
        count[0] += 1
        sched.add_request(TokenizedRequest(f"t{count[0]}", ids, SamplingParams(**params), seed=0))
        while sched.has_work():
            sched.step()
        if cuda:
            torch.cuda.synchronize()

    with startup_heap_frozen():  # as the engine's scheduler process serves (engine/heap.py)
        ms = median_ms(run, prompts(WARMUP + args.requests, args.prompt_len, seed=1))
        if args.profile:
            profile(run, prompts(10, args.prompt_len, seed=2), cuda)
    return ms, proc


def profile(run, ids_list: list[list[int]], cuda: bool) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for ids in ids_list:
        run(ids)
    profiler.disable()
    print(
        f"--- host time of {len(ids_list)} requests in-process (cProfile, by own time)",
        file=sys.stderr,
    )
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(20)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run(ids_list[0])
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60)
    print(f"--- one request under torch.profiler\n{table}", file=sys.stderr)
    if cuda:
        from profile_step import print_device_busy

        print_device_busy(prof, steps=1)


def engine_layer(options: dict, args, params: dict) -> float:
    from rollout import RolloutEngine

    with RolloutEngine(**options) as engine:
        return median_ms(
            lambda ids: engine.generate(input_ids=ids, sampling_params=params),
            prompts(WARMUP + args.requests, args.prompt_len, seed=3),
        )


def http_layer(options: dict, args, params: dict, tmp: str) -> float:
    from bench_pool import start, stop, wait_healthy
    from bench_router_overhead import free_port

    flags = []
    for key, value in options.items():
        if key != "model_path" and value is not None:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    port = free_port()
    proc = start(["serve", "--model-path", options["model_path"], *flags], port, tmp)
    try:
        wait_healthy(port, proc)
        with requests.Session() as session:

            def run(ids: list[int]) -> None:
                body = {"input_ids": ids, "sampling_params": params}
                reply = session.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=120)
                reply.raise_for_status()

            return median_ms(run, prompts(WARMUP + args.requests, args.prompt_len, seed=4))
    finally:
        stop([proc])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", help=f"checkpoint dir or one of {sorted(REAL_CONFIGS)}; default: tiny (CPU)"
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--prompt-len", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=1)
    parser.add_argument("--requests", type=int, default=100, help="counted requests per layer")
    parser.add_argument("--layers", nargs="+", default=["scheduler", "engine", "http"],
                        choices=["scheduler", "engine", "http"])  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true", help="cProfile and torch.profiler of the in-process layer"
    )
    parser.add_argument(
        "--extend-graph-tokens", type=int, help="cuda_graph_max_extend_tokens (0: eager extends)"
    )
    args = parser.parse_args()
    if args.prompt_len < 1 or args.new_tokens < 1 or args.requests < 1:
        parser.error("--prompt-len, --new-tokens and --requests must be >= 1")

    tmp = tempfile.mkdtemp(prefix="bench-turn-")
    options = {
        "device": args.device,
        "dtype": args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
        "max_total_tokens": 16384,
    }
    if args.extend_graph_tokens is not None:
        options["cuda_graph_max_extend_tokens"] = args.extend_graph_tokens
    if args.model is None:
        from rollout.tiny_model import make_tiny_model

        options["model_path"] = make_tiny_model(os.path.join(tmp, "tiny"), "qwen3", seed=2)
    elif os.path.isdir(args.model):
        options["model_path"] = args.model
    elif args.model.lower() in REAL_CONFIGS:
        options["model_path"] = write_config_checkpoint(
            args.model.lower(), os.path.join(tmp, "model")
        )
        options["load_format"] = "dummy"
    else:
        parser.error(f"--model must be a checkpoint directory or one of {sorted(REAL_CONFIGS)}")
    params = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}

    result = {
        "model": args.model or "tiny",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
    }
    if "scheduler" in args.layers:
        ms, proc = scheduler_layer(options, args, params)
        result["scheduler_ms"] = round(ms, 3)
        result["device"] = str(proc.runner.device)
        result["startup_s"] = round(proc.startup_s, 2)  # model, KV, graphs and warm-up
        result["extend_graph_max_tokens"] = proc.runner.kernel_plan.extend_graph_max_tokens
        del proc
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if "engine" in args.layers:
        result["engine_ms"] = round(engine_layer(options, args, params), 3)
    if "http" in args.layers:
        result["http_ms"] = round(http_layer(options, args, params, tmp), 3)
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
