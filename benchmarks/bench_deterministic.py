"""Deterministic inference (issue 24) on a real model's shapes: invariance, then cost.

    python benchmarks/bench_deterministic.py --model qwen3-0.6b --dtype bfloat16
    python benchmarks/bench_deterministic.py --model qwen2.5-7b --dtype bfloat16 --skip-cost

1. Invariance: a few requests (sampled at temperature 1 with their own seeds, logprobs on) are
   generated alone, then inside batches of 1 to 256 requests (--batch-sizes), by engines with
   enable_deterministic_inference (CUDA graphs on, as by default). Prints, per batch size,
   whether every one got the same token ids and bit-identical logprobs.
2. Cost: the nano workload (--num-seqs, --max-len; bench_offline.py's) with the mode off and
   on, one engine after the other in this process; prints both output tokens/s and on / off.

A NAME of rollout.real_configs runs that config with random weights. One JSON line per result.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import nano_workload, token_ids  # noqa: E402

from rollout import RolloutEngine  # noqa: E402
from rollout.real_configs import REAL_CONFIGS, write_config_checkpoint  # noqa: E402

NUM_TARGETS = 3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", required=True, help=f"checkpoint dir or one of {sorted(REAL_CONFIGS)}"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch-sizes", default="1,3,8,32,64,256", help="comma-separated")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per invariance request")
    parser.add_argument("--num-seqs", type=int, default=256, help="nano workload sequences")
    parser.add_argument("--max-len", type=int, default=1024, help="nano workload max length")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-invariance", action="store_true")
    return parser.parse_args()


def _engine(path: str, args: argparse.Namespace, deterministic: bool, dummy: bool) -> RolloutEngine:
    options = {"dtype": args.dtype, "enable_deterministic_inference": deterministic}
    if args.device:
        options["device"] = args.device
    if dummy:
        options["load_format"] = "dummy"
    return RolloutEngine(path, **options)


def _sampled(engine: RolloutEngine, prompts: list[list[int]], params: list[dict]) -> list[tuple]:
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    return [
        (o["output_ids"], [e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in outs
    ]


def check_invariance(path: str, args: argparse.Namespace, dummy: bool, vocab: int) -> None:
    rng = random.Random(1)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    count = max(sizes) + NUM_TARGETS
    prompts = [token_ids(rng, rng.randint(16, 300), vocab) for _ in range(count)]
    params = [
        {"temperature": 1.0, "seed": 1000 + i, "ignore_eos": True,
         "max_new_tokens": args.new_tokens if i < NUM_TARGETS else rng.randint(1, 2 * args.new_tokens)}
        for i in range(count)
    ]  # fmt: skip
    with _engine(path, args, True, dummy) as engine:
        alone = [_sampled(engine, [prompts[i]], [params[i]])[0] for i in range(NUM_TARGETS)]
    for size in sizes:
        # A fresh engine each time: across restarts too. The targets sit among the others.
        others = list(range(NUM_TARGETS, NUM_TARGETS + max(size - NUM_TARGETS, 0)))
        order = (
            others[: len(others) // 2]
            + list(range(min(size, NUM_TARGETS)))
            + others[len(others) // 2 :]
        )
        with _engine(path, args, True, dummy) as engine:
            got = _sampled(engine, [prompts[i] for i in order], [params[i] for i in order])
        same = all(got[order.index(i)] == alone[i] for i in range(min(size, NUM_TARGETS)))
        print(
            json.dumps({"check": "invariance", "batch_size": size, "identical": same}), flush=True
        )


def measure_cost(path: str, args: argparse.Namespace, dummy: bool, vocab: int) -> None:
    prompts, params = nano_workload(args.num_seqs, args.max_len, vocab)
    tokens_per_s = {}
    for deterministic in (False, True):
        with _engine(path, args, deterministic, dummy) as engine:
            # Warm-up at the workload's batch width (as bench_offline.py): kernels compiled on
            # first use, for any number of rows, are not timed.
            warm = [{**p, "max_new_tokens": 4} for p in params[:64]]
            engine.generate(input_ids=prompts[:64], sampling_params=warm)
            start = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            seconds = time.perf_counter() - start
        tokens_per_s[deterministic] = sum(len(o["output_ids"]) for o in outs) / seconds
    print(json.dumps({
        "check": "cost", "workload": f"nano {args.num_seqs} seqs, lengths 100-{args.max_len}",
        "off_tok_per_s": round(tokens_per_s[False], 1), "on_tok_per_s": round(tokens_per_s[True], 1),
        "on_over_off": round(tokens_per_s[True] / tokens_per_s[False], 3),
    }), flush=True)  # fmt: skip


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-deterministic-") as tmp:
        dummy = args.model in REAL_CONFIGS
        path = write_config_checkpoint(args.model, tmp) if dummy else args.model
        with open(os.path.join(path, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        if not args.skip_invariance:
            check_invariance(path, args, dummy, vocab)
        if not args.skip_cost:
            measure_cost(path, args, dummy, vocab)


if __name__ == "__main__":
    main()
