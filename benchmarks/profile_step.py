"""Profiles decode steps of the scheduler in-process: wall time per step and the top ops.

    python benchmarks/profile_step.py --model qwen3-0.6b --batch 64 --prompt-len 256
    python benchmarks/profile_step.py --model qwen2.5-7b --batch 64 --lora-ranks 16 32 64 16
    python benchmarks/profile_step.py --model qwen3-0.6b --batch 256 --deterministic-inference

With --extend it profiles the prefill of the batch's prompts instead (chunked as the
scheduler chunks them): wall time per extend step and the top ops over all of them.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_lora import write_adapter  # noqa: E402
from decode_launch import set_decode_launch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from rollout.config import CacheOptions, EngineOptions, KernelOptions  # noqa: E402
from rollout.engine.heap import startup_heap_frozen  # noqa: E402
from rollout.engine.messages import TokenizedRequest  # noqa: E402
from rollout.engine.sampling_params import SamplingParams  # noqa: E402
from rollout.engine.scheduler_process import SchedulerProcess  # noqa: E402
from rollout.real_configs import REAL_CONFIGS, write_config_checkpoint  # noqa: E402


def main() -> None:
    kernels, cache = KernelOptions(), CacheOptions()  # the engine's defaults
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default=kernels.attention_backend)
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--cprofile", action="store_true", help="also print the Python functions taking the host's time")
    parser.add_argument("--extend", action="store_true", help="profile the prompts' prefill steps instead of decode")
    parser.add_argument("--skinny-gemm-max-rows", type=int, default=kernels.skinny_gemm_max_rows)
    parser.add_argument("--kv-cache-dtype", default=cache.kv_cache_dtype, help="auto, fp8_e4m3 or fp8_e5m2")
    parser.add_argument("--disable-pdl", action="store_true",
                        help="no programmatic dependent launch (under it a kernel's wait for its predecessor counts as its own time)")
    parser.add_argument("--trace", help="also write the profiled decode steps as a Chrome trace here")
    parser.add_argument("--deterministic-inference", action="store_true", help="the batch-invariant kernels (issue 24)")
    parser.add_argument("--return-logprob", action="store_true", help="every request returns its tokens' logprobs")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (1: no filter)")
    parser.add_argument("--large-decode-min-batch", type=int, default=kernels.large_decode_min_batch,
                        help="decode batches of at least this many rows on the large batches' Triton kernel (0: never)")  # fmt: skip
    parser.add_argument("--large-decode-piece-keys", type=int, default=kernels.large_decode_piece_keys,
                        help="its keys per piece of a request (0: the unsplit kernel)")  # fmt: skip
    parser.add_argument("--decode-split-keys", type=int, help="keys per piece of the Triton decode kernel")
    parser.add_argument("--decode-block-n", type=int, help="keys per loop step of the Triton decode kernel (bf16)")
    parser.add_argument("--lora-ranks", type=int, nargs="+", default=[],
                        help="one random adapter (all projections) per rank given; the requests take them in turn")  # fmt: skip
    args = parser.parse_args()
    set_decode_launch(args.decode_split_keys, args.decode_block_n)  # before graphs are captured
    options = {
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
        "skinny_gemm_max_rows": args.skinny_gemm_max_rows,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_total_tokens": args.batch * (args.prompt_len + 4 * args.steps) + 64,
        "disable_overlap_schedule": args.disable_overlap_schedule,
        "deterministic_inference": args.deterministic_inference,
        "disable_pdl": args.disable_pdl,
        "large_decode_min_batch": args.large_decode_min_batch,
        "large_decode_piece_keys": args.large_decode_piece_keys,
    }
    model = args.model
    if not os.path.isdir(model):
        model = write_config_checkpoint(model, tempfile.mkdtemp())
        options["load_format"] = "dummy"
    assert args.model in REAL_CONFIGS or os.path.isdir(args.model)
    adapters = [f"a{i}" for i in range(len(args.lora_ranks))]
    if adapters:
        root, config = tempfile.mkdtemp(), AutoConfig.from_pretrained(model)
        options.update(
            enable_lora=True, max_loras_per_batch=len(adapters), max_lora_rank=max(args.lora_ranks),
            lora_paths=[f"{a}={write_adapter(config, r, i, os.path.join(root, a))}"
                        for i, (a, r) in enumerate(zip(adapters, args.lora_ranks))],
        )  # fmt: skip
    proc = SchedulerProcess(EngineOptions.from_kwargs(model_path=model, **options))
    with startup_heap_frozen():  # as the engine's scheduler process serves (engine/heap.py)
        profile(proc.scheduler, args, adapters)


def profile(sched, args: argparse.Namespace, adapters: list[str]) -> None:
    """Fills a batch of args.batch requests, times args.steps decode steps (or profiles the
    prefill, with --extend), then profiles five."""
    if args.extend:  # first compiles and lazy initialisation outside the profile
        sched.add_request(TokenizedRequest("warm-up", [1, 2, 3], SamplingParams(max_new_tokens=1), seed=0))
        while sched.has_work():
            sched.step()
    rng = random.Random(0)
    for i in range(args.batch):
        ids = [rng.randrange(10000) for _ in range(args.prompt_len)]
        params = SamplingParams(temperature=0.6, top_p=args.top_p, ignore_eos=True, max_new_tokens=4 * args.steps)
        lora = adapters[i % len(adapters)] if adapters else None
        sched.add_request(
            TokenizedRequest(f"r{i}", ids, params, seed=i, lora_name=lora, return_logprob=args.return_logprob)
        )
    if args.extend:
        profile_extend(sched, args.batch * args.prompt_len, args.cprofile)
        return
    while sched.waiting or sched.chunked:
        sched.step()
    for _ in range(3):
        sched.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        sched.step()
    torch.cuda.synchronize()
    mode = "off" if args.disable_overlap_schedule else "on"
    ms = (time.perf_counter() - start) / args.steps * 1000
    print(f"decode step, batch {args.batch}, overlap {mode}: {ms:.2f} ms")
    if args.cprofile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            sched.step()
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(5):
            sched.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))
    print_device_busy(prof, steps=5)
    if args.trace:
        prof.export_chrome_trace(args.trace)


def print_device_busy(prof, steps: int) -> None:
    """How much of the profiled span the GPU ran kernels: the union of the kernels' intervals
    against the span from the first kernel's start to the last one's end."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not spans:
        return
    busy, run_start, run_end = 0.0, *spans[0]
    for start, end in spans[1:]:
        if start > run_end:
            busy, run_start = busy + run_end - run_start, start
        run_end = max(run_end, end)
    busy += run_end - run_start
    total = spans[-1][1] - spans[0][0]
    print(f"device busy {busy / steps / 1000:.3f} ms of {total / steps / 1000:.3f} ms per step "
          f"({len(spans) / steps:.0f} device events per step)")


def profile_extend(sched, prompt_tokens: int, cprofile: bool) -> None:
    """The scheduler's prefill of every waiting prompt, under the profiler (with `cprofile`,
    under cProfile instead: the Python functions taking the host's time)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    steps = 0
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    profiler = cProfile.Profile() if cprofile else torch.profiler.profile(activities=activities)
    with profiler:
        start = time.perf_counter()
        while sched.waiting or sched.chunked:
            sched.step()
            steps += 1
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    print(f"prefill of {prompt_tokens} prompt tokens: {steps} steps, {seconds * 1000 / steps:.2f} ms/step, "
          f"{prompt_tokens / seconds:.0f} tok/s (profiled)")
    if cprofile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    else:
        print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
