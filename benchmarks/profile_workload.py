"""Where a whole offline workload's time goes, step by step, in the scheduler's own process.

    python benchmarks/profile_workload.py --model qwen3-0.6b --workload nano

Runs a bench_offline workload through the scheduler directly (no tokenizer or detokenizer
process) and times every step: its kind, its batch size, its wall time, and how long it waited
for the device (`LaunchedStep.wait`). A step that hardly waits is bound by the host's work; one
that waits most of its time is bound by the device. Prints totals per step kind and per decode
batch-size bucket, then (with --cprofile, in a second run) the Python functions that took the
host's time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.decode_launch import set_decode_launch  # noqa: E402
from benchmarks.workloads import (  # noqa: E402
    DEFAULT_MAX_LEN,
    DEFAULT_NUM_SEQS,
    MAX_LEN_ONLY,
    WORKLOADS,
    draw,
    longest_lengths,
)
from rollout.config import CacheOptions, EngineOptions, KernelOptions  # noqa: E402
from rollout.engine import launched_step  # noqa: E402
from rollout.engine.busy_timer import step_kind  # noqa: E402
from rollout.engine.heap import startup_heap_frozen  # noqa: E402
from rollout.engine.messages import TokenizedRequest  # noqa: E402
from rollout.engine.sampling_params import SamplingParams  # noqa: E402
from rollout.engine.scheduler_process import SchedulerProcess  # noqa: E402
from rollout.real_configs import write_config_checkpoint  # noqa: E402

_waited = [0.0]


def _timed_wait(self) -> None:
    start = time.perf_counter()
    if self.ready is not None:
        self.ready.synchronize()
    _waited[0] += time.perf_counter() - start


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(sched, prompts, params, return_logprob=False) -> list[tuple[str, int, float, float]]:
    vocab = sched.runner.vocab_size  # tiny test checkpoints have fewer ids than the workloads use
    for i, (ids, p) in enumerate(zip(prompts, params)):
        ids = [t % vocab for t in ids]
        for j in range(p.pop("n", 1)):
            sched.add_request(
                TokenizedRequest(f"r{i}-{j}", ids, SamplingParams(**p), seed=i * 8 + j, return_logprob=return_logprob)
            )
    steps = []
    sync()
    runner = sched.runner
    launch, run_model = runner.launch, runner._run_model
    launched = []
    timing = torch.cuda.is_available()

    def mark() -> torch.cuda.Event | None:
        if not timing:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def recording_run_model(fb):
        marks.append(mark())
        out = run_model(fb)
        marks.append(mark())
        return out

    def recording_launch(batch):
        launched.append((batch.mode.value, len(batch.reqs)))
        marks.append(mark())
        step = launch(batch)
        marks.append(mark())
        return step

    runner.launch, runner._run_model = recording_launch, recording_run_model
    while sched.has_work():
        _waited[0] = 0.0
        launched.clear()
        marks = []
        start = time.perf_counter()
        sched.step()
        mode, size = launched[0] if launched else ("drain", 0)
        steps.append([mode, size, time.perf_counter() - start, _waited[0], marks])
    runner.launch, runner._run_model = launch, run_model
    sync()
    # Device time of each step: [launch start, model start, model end, launch end] events.
    previous_end = None
    for step in steps:
        marks = step.pop()
        if len(marks) != 4 or marks[0] is None:
            step += [0.0, 0.0, 0.0, 0.0]
            continue
        begin, model_start, model_end, end = marks
        idle = previous_end.elapsed_time(begin) if previous_end is not None else 0.0
        prep = begin.elapsed_time(model_start)
        step += [model_start.elapsed_time(model_end), begin.elapsed_time(end), prep, idle]
        previous_end = end
    sync()
    return steps


def pick_workload(args: argparse.Namespace, vocab: int):
    """The prompts and sampling params of --workload at its default sizes."""
    w = args.workload
    if w in MAX_LEN_ONLY:  # --output-len is rl's --max-len
        max_len = (w == "rl" and args.output_len) or DEFAULT_MAX_LEN[w]
        input_len, output_len = longest_lengths(w, max_len)
    else:
        input_len, output_len = args.input_len, args.output_len or 1024
    return draw(w, args.num_seqs or DEFAULT_NUM_SEQS[w], input_len, output_len, vocab)


def main() -> None:
    kernels, cache = KernelOptions(), CacheOptions()  # the engine's defaults
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--workload", choices=WORKLOADS, default="nano")
    parser.add_argument("--num-seqs", type=int)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, help="fixed, random: 1024; rl: max output length (4096)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default=kernels.attention_backend)
    parser.add_argument("--decode-attention-backend", default=kernels.decode_attention_backend)
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument(
        "--decode-split-keys", type=int,
        help="keys per piece of the Triton decode kernel's split-KV (to compare piece lengths)",
    )  # fmt: skip
    parser.add_argument("--decode-block-n", type=int, help="keys per loop step of the Triton decode kernel (bf16)")
    parser.add_argument("--triton-decode-max-batch", type=int, default=kernels.triton_decode_max_batch)
    parser.add_argument("--kv-cache-dtype", default=cache.kv_cache_dtype, help="auto, fp8_e4m3 or fp8_e5m2")
    args = parser.parse_args()
    set_decode_launch(args.decode_split_keys, args.decode_block_n)
    dummy = not os.path.isdir(args.model)
    model = write_config_checkpoint(args.model, tempfile.mkdtemp()) if dummy else args.model
    options = EngineOptions.from_kwargs(
        model_path=model, load_format="dummy" if dummy else "auto", dtype=args.dtype,
        attention_backend=args.attention_backend, decode_attention_backend=args.decode_attention_backend,
        triton_decode_max_batch=args.triton_decode_max_batch, kv_cache_dtype=args.kv_cache_dtype,
        disable_overlap_schedule=args.disable_overlap_schedule,
    )  # fmt: skip
    sched = SchedulerProcess(options).scheduler
    launched_step.LaunchedStep.wait = _timed_wait
    with startup_heap_frozen():  # as the engine's scheduler process serves (engine/heap.py)
        measure(sched, args)


def measure(sched, args: argparse.Namespace) -> None:
    """Runs the workload once, prints its steps by kind, and with --cprofile runs it again under
    the profiler."""
    run(sched, [[1, 2, 3]], [{"max_new_tokens": 4}])  # warm-up
    start = time.perf_counter()
    logprob = args.workload == "rl"  # as an RL trainer asks
    steps = run(sched, *pick_workload(args, sched.runner.vocab_size), return_logprob=logprob)
    total = time.perf_counter() - start
    keys = "" if args.decode_split_keys is None else f", decode pieces of {args.decode_split_keys} keys"
    keys += "" if args.decode_block_n is None else f", decode blocks of {args.decode_block_n} keys"
    print(f"{args.workload} on {args.model}: {total:.2f} s, {len(steps)} steps{keys}, decode on {sched.runner.kernel_plan.decode_attention}")
    decode = [size for mode, size, *_ in steps if mode == "decode"]
    if decode:
        print(f"mean decode batch {sum(decode) / len(decode):.1f}; scheduler stats {sched.stats}")
    # Per kind: steps, host seconds, fraction of it waiting for the device, and device ms per
    # step: the model forward, the whole launch (inputs, forward, sampling, copies), the part of
    # the launch before the forward (input copies and plans, and the device waiting for the host
    # to queue the forward), and the device's idle time between the previous launch's end and
    # this one's start.
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    for mode, size, *values in steps:
        key = step_kind(True, size) if mode == "decode" else mode
        rows[key][0] += 1
        for i, value in enumerate(values, 1):
            rows[key][i] += value
    print(f"{'steps':<16}{'count':>7}{'seconds':>9}{'ms/step':>9}{'waited':>8}{'model':>8}{'launch':>8}{'prep':>8}{'idle':>8}")
    for key in sorted(rows, key=lambda k: (k.startswith("decode"), len(k), k)):
        n, wall, waited, model_ms, launch_ms, prep_ms, idle_ms = rows[key]
        print(
            f"{key:<16}{n:>7}{wall:>9.2f}{wall / n * 1000:>9.2f}{waited / max(wall, 1e-9):>8.0%}"
            f"{model_ms / n:>8.2f}{launch_ms / n:>8.2f}{prep_ms / n:>8.2f}{idle_ms / n:>8.2f}"
        )
    if args.cprofile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        run(sched, *pick_workload(args, sched.runner.vocab_size), return_logprob=logprob)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
