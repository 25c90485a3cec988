"""The scheduler alone on a workload, with a cost model in place of the GPU: an estimate.

    python benchmarks/simulate_schedule.py --model llama-3.1-8b --workload random \\
        --num-seqs 500 --input-len 4096 --output-len 2048 --kv-tokens 423842
    python benchmarks/simulate_schedule.py --model qwen2.5-7b --workload rl --kv-tokens 980000

Runs the real Scheduler (admission, chunked prefill, retraction, prefix cache) over a runner
that computes nothing and returns token 7 at once, and charges each step what a roofline says
it costs on the device: a decode step reads the weights (or does 2 x params FLOPs a row at
--flops, if that is slower: a batch of several hundred rows) and every running request's KV at
--bandwidth; a prefill step does 2 x params FLOPs per token plus its attention at --flops (or
reads the weights, if that is slower). Prints the estimated seconds and output tokens/s, the
steps of each kind, the mean decode batch and the retractions. Every number is a model of the
device, not a measurement: use it to compare scheduling choices, or to see how far a measured
run is from the roofline of its own schedule.

The workloads are bench_offline.py's, drawn the same way (the model's vocabulary folds the token
ids); --num-seqs and --output-len default to each one's own (rl: 128 prompts x 8 samples of up to
4096 tokens), --input-len to 4096 (fixed, random). The time at which the last sample finished is
printed too: with a long tail of lengths (rl), the last steps run few requests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_gemv import projections  # noqa: E402
from benchmarks.workloads import (  # noqa: E402
    DEFAULT_MAX_LEN,
    DEFAULT_NUM_SEQS,
    MAX_LEN_ONLY,
    WORKLOADS,
    draw,
    longest_lengths,
)
from rollout.config import EngineOptions, SchedulerOptions  # noqa: E402
from rollout.engine.busy_timer import step_kind  # noqa: E402
from rollout.engine.launched_step import LaunchedStep, ReqStepOutput  # noqa: E402
from rollout.engine.messages import TokenizedRequest  # noqa: E402
from rollout.engine.sampling_params import SamplingParams  # noqa: E402
from rollout.engine.scheduler import Scheduler  # noqa: E402
from rollout.engine.stop_checker import StopChecker  # noqa: E402
from rollout.forward.forward_batch import ForwardMode  # noqa: E402
from rollout.forward.kv_pool import ReqToTokenPool  # noqa: E402
from rollout.real_configs import REAL_CONFIGS  # noqa: E402

BYTES = 2  # bf16 weights and KV


def model_sizes(cfg: dict, kv_element_bytes: int = BYTES) -> tuple[int, int, int]:
    """(parameters a token's forward multiplies, KV bytes per token, attention width q x layers)."""
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    # The layers' projections and the LM head; the embedding is a lookup.
    params = sum(n * k * (1 if name == "lm_head" else layers) for name, n, k, _ in projections(cfg))
    kv_bytes = 2 * layers * kv_heads * head_dim * kv_element_bytes
    return params, kv_bytes, layers * heads * head_dim


class RooflineRunner:
    """What the Scheduler needs of a ModelRunner, with device time charged by a roofline."""

    device = torch.device("cpu")  # where the scheduler's step timer measures: nothing of note

    def __init__(self, args: argparse.Namespace, cfg: dict) -> None:
        self.num_slots = args.kv_tokens
        self.context_length = args.input_len + args.output_len + 1
        self.req_to_token = ReqToTokenPool(args.max_running_requests + 1, self.context_length + 1, "cpu")
        self.params, self.kv_bytes, self.attn_width = model_sizes(cfg, args.kv_element_bytes)
        self.bandwidth, self.flops = args.bandwidth, args.flops
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.decode_batches: list[int] = []
        self.by_kind: dict[str, list] = {}  # step kind (busy_timer.step_kind) -> [steps, seconds]

    def launch(self, batch) -> LaunchedStep:
        weights = self.params * BYTES / self.bandwidth
        decode = batch.mode is ForwardMode.DECODE
        if decode:
            context = sum(start + 1 for start in batch.starts)
            # The projections read the weights once, or past a few hundred rows are bound by
            # their FLOPs; attention reads every running request's KV.
            gemms = max(weights, 2 * self.params * len(batch.reqs) / self.flops)
            cost = gemms + context * self.kv_bytes / self.bandwidth
            self.seconds["decode"] += cost
            self.decode_batches.append(len(batch.reqs))
        else:
            tokens = sum(batch.extend_lens)
            # q.k and p.v over the prefix and the causal half of the new tokens.
            attn = sum(4 * self.attn_width * e * (s + e / 2) for s, e in zip(batch.starts, batch.extend_lens))
            cost = max(weights, (2 * self.params * tokens + attn) / self.flops)
            self.seconds["prefill"] += cost
        entry = self.by_kind.setdefault(step_kind(decode, len(batch.reqs)), [0, 0.0])
        entry[0] += 1
        entry[1] += cost
        outs = [ReqStepOutput(next_token=7 if batch.samples(i) else None) for i in range(len(batch.reqs))]
        return LaunchedStep(batch, [], outs)

    def resolve(self, step: LaunchedStep) -> list[ReqStepOutput]:
        return step.outputs()


def workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[dict]]:
    """bench_offline's workload; sets args.input_len and args.output_len to its longest."""
    w = args.workload
    args.num_seqs = args.num_seqs or DEFAULT_NUM_SEQS[w]
    args.output_len = args.output_len or (2048 if w in ("random", "fixed") else DEFAULT_MAX_LEN[w])
    if w in MAX_LEN_ONLY:  # --output-len is grpo's and rl's --max-len
        max_len = args.output_len if w in ("grpo", "rl") else DEFAULT_MAX_LEN[w]
        args.input_len, args.output_len = longest_lengths(w, max_len)
    return draw(w, args.num_seqs, args.input_len, args.output_len, vocab_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b", choices=sorted(REAL_CONFIGS))
    parser.add_argument("--workload", choices=WORKLOADS, default="random")
    parser.add_argument("--num-seqs", type=int, help="the workload's own default (random: 500)")
    parser.add_argument("--input-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, help="default: the workload's own (random: 2048)")
    parser.add_argument("--kv-tokens", type=int, required=True, help="KV pool size, as the engine reports it")
    parser.add_argument("--max-running-requests", type=int, help="default: the engine's for --kv-tokens")
    parser.add_argument(
        "--kv-element-bytes", type=int, default=BYTES,
        help="bytes per cached K/V element (2: bf16; 1: an 8-bit cache, with twice the --kv-tokens in the same memory)",
    )  # fmt: skip
    parser.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s (H100: 3.0e12 measured copy)")
    parser.add_argument("--flops", type=float, default=7.5e14, help="prefill FLOP/s reached (bf16; an H100 reached ~7.5e14 on Llama-3.1-8B)")
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--by-step", action="store_true", help="also print the estimate by step kind (a JSON line)")
    args = parser.parse_args()
    running = SchedulerOptions(max_running_requests=args.max_running_requests)
    args.max_running_requests = running.running_limit(args.kv_tokens)

    prompts, params = workload(args, REAL_CONFIGS[args.model]["vocab_size"])
    runner = RooflineRunner(args, REAL_CONFIGS[args.model])
    options = EngineOptions.from_kwargs(
        model_path="unused", max_running_requests=args.max_running_requests,
        disable_radix_cache=args.disable_radix_cache,
    )  # fmt: skip
    sched = Scheduler(options, runner, StopChecker(None, []))
    for i, (ids, p) in enumerate(zip(prompts, params)):
        for j in range(p.pop("n", 1)):
            sched.add_request(TokenizedRequest(f"r{i}-{j}", ids, SamplingParams(**p), seed=i))
    steps, finished = 0, []  # the estimated time at which each request finished
    while sched.has_work():
        done = [r for r in sched.step() if r.finished]
        finished += [sum(runner.seconds.values())] * len(done)
        steps += 1
    total = sum(runner.seconds.values())
    tokens = sched.stats["generated_tokens"]
    batches = runner.decode_batches
    p90 = sorted(finished)[int(0.9 * (len(finished) - 1))]
    print(
        f"estimate: {total:.1f} s ({runner.seconds['prefill']:.1f} prefill, {runner.seconds['decode']:.1f} decode), "
        f"{tokens / total:.0f} output tok/s; {steps} steps, {len(batches)} decode, mean decode batch "
        f"{sum(batches) / max(len(batches), 1):.1f}; {sched.stats['retractions']} retractions; "
        f"90% of {len(finished)} samples done at {p90:.1f} s, the last at {max(finished):.1f} s; "
        f"max_running_requests {args.max_running_requests}"
    )
    if args.by_step:  # as bench_offline's "steps": the estimate's device ms a step by kind
        steps = {k: {"steps": n, "device_ms": round(1000 * t / n, 3)} for k, (n, t) in sorted(runner.by_kind.items())}
        print(json.dumps(steps))


if __name__ == "__main__":
    main()
