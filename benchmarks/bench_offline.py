"""Offline throughput: prints one JSON line with output_tok_per_s.

    python benchmarks/bench_offline.py --model qwen3-0.6b --workload nano
    python benchmarks/bench_offline.py --model /path/to/ckpt --workload grpo --num-seqs 8 --max-len 64
    python benchmarks/bench_offline.py --model qwen2.5-7b --workload fixed --num-seqs 64 --max-len 256 --compare hf
    python benchmarks/bench_offline.py --model llama-3.1-8b --workload random --num-seqs 500 --input-len 4096 --output-len 2048

`nano` is the nano-vllm workload (256 sequences, input and output lengths uniform in
100..1024, `random.seed(0)`, prompts drawn before output lengths, token ids in [0, 10000),
temperature 0.6, ignore_eos). `grpo` is 64 prompts x n=8 samples. `fixed` is num_seqs greedy
requests of exactly max_len prompt and max_len output tokens (or --input-len / --output-len).
`random` is SGLang's random dataset as its CI benchmarks it (`bench_serving --dataset-name
random`, range ratio 0): prompt lengths uniform in [1, input_len] and output lengths uniform in
[1, output_len] (`--range-ratio r` raises both lower bounds to r x the length), ignore_eos,
greedy. A NAME of a real model (see
REAL_CONFIGS) runs its real config with random weights (speed does not depend on them).
`--compare hf` then runs transformers `generate` on the same model and prompts in this process
(after the engine has shut down), in left-padded batches of --hf-batch-size, and prints the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout import RolloutEngine  # noqa: E402
from rollout.config import ModelOptions  # noqa: E402
from rollout.real_configs import REAL_CONFIGS, write_config_checkpoint  # noqa: E402


def nano_workload(num_seqs: int, max_len: int) -> tuple[list[list[int]], list[dict]]:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_len))] for _ in range(num_seqs)]
    params = [
        {"temperature": 0.6, "ignore_eos": True, "max_new_tokens": random.randint(100, max_len)}
        for _ in range(num_seqs)
    ]
    return prompts, params


def grpo_workload(num_prompts: int, max_len: int) -> tuple[list[list[int]], list[dict]]:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(64, 512))] for _ in range(num_prompts)]
    params = [
        {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": max_len, "n": 8}
        for _ in range(num_prompts)
    ]
    return prompts, params


def fixed_workload(num_seqs: int, input_len: int, output_len: int) -> tuple[list[list[int]], list[dict]]:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(input_len)] for _ in range(num_seqs)]
    params = [{"temperature": 0, "ignore_eos": True, "max_new_tokens": output_len} for _ in range(num_seqs)]
    return prompts, params


def random_workload(
    num_seqs: int, input_len: int, output_len: int, range_ratio: float
) -> tuple[list[list[int]], list[dict]]:
    rng = random.Random(0)
    prompts, params = [], []
    for _ in range(num_seqs):
        n_in = rng.randint(max(int(input_len * range_ratio), 1), input_len)
        n_out = rng.randint(max(int(output_len * range_ratio), 1), output_len)
        prompts.append([rng.randint(0, 10000) for _ in range(n_in)])
        params.append({"temperature": 0, "ignore_eos": True, "max_new_tokens": n_out})
    return prompts, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help=f"checkpoint dir or one of {sorted(REAL_CONFIGS)}")
    parser.add_argument("--workload", choices=["nano", "grpo", "fixed", "random"], default="nano")
    parser.add_argument("--num-seqs", type=int, help="sequences (nano, default 256) or prompts (grpo, default 64)")
    parser.add_argument(
        "--max-len", type=int, help="max input/output length (nano: 1024; grpo output: 512; fixed: 256)"
    )
    parser.add_argument("--input-len", type=int, help="fixed: prompt length (default: --max-len)")
    parser.add_argument("--output-len", type=int, help="fixed: output length (default: --max-len)")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="random: lower bound of the lengths, as a fraction")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--max-total-tokens", type=int)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--compare", choices=["hf"], help="also time transformers generate")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8_e4m3 or fp8_e5m2")
    parser.add_argument("--skinny-gemm-max-rows", type=int, default=ModelOptions().skinny_gemm_max_rows)
    parser.add_argument("--triton-decode-max-batch", type=int, default=ModelOptions().triton_decode_max_batch)
    args = parser.parse_args()

    options: dict = {
        "dtype": args.dtype,
        "device": args.device,
        "disable_radix_cache": args.disable_radix_cache,
        "attention_backend": args.attention_backend,
        "disable_cuda_graph": args.disable_cuda_graph,
        "disable_overlap_schedule": args.disable_overlap_schedule,
        "kv_cache_dtype": args.kv_cache_dtype,
        "skinny_gemm_max_rows": args.skinny_gemm_max_rows,
        "triton_decode_max_batch": args.triton_decode_max_batch,
    }
    if args.max_total_tokens:
        options["max_total_tokens"] = args.max_total_tokens
    model = args.model
    if not os.path.isdir(model):
        if model.lower() not in REAL_CONFIGS:
            parser.error(f"--model must be a checkpoint directory or one of {sorted(REAL_CONFIGS)}")
        model = write_config_checkpoint(model.lower(), tempfile.mkdtemp(prefix="rollout-bench-"))
        options["load_format"] = "dummy"

    if args.workload == "nano":
        prompts, params = nano_workload(args.num_seqs or 256, args.max_len or 1024)
    elif args.workload == "grpo":
        prompts, params = grpo_workload(args.num_seqs or 64, args.max_len or 512)
    elif args.workload == "random":
        length = args.max_len or 1024
        prompts, params = random_workload(
            args.num_seqs or 500, args.input_len or length, args.output_len or length, args.range_ratio
        )
    else:
        length = args.max_len or 256
        prompts, params = fixed_workload(args.num_seqs or 64, args.input_len or length, args.output_len or length)
    expected_tokens = sum(p["max_new_tokens"] * p.get("n", 1) for p in params)

    with RolloutEngine(model, **options) as engine:
        # Warm-up with the workload's own sampling settings at its batch width, so that kernels
        # compiled on first use (Triton's sampling variants) are not timed.
        warm = [{**p, "max_new_tokens": 4} for p in params[:64]]
        engine.generate(input_ids=[p[:16] for p in prompts[:64]], sampling_params=warm)
        engine.flush_cache()  # the timed run reuses nothing the warm-up computed
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        info = engine.get_server_info()
    output_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    assert output_tokens == expected_tokens, (output_tokens, expected_tokens)
    result = {
        "workload": args.workload,
        "model": args.model,
        "num_seqs": len(outs),
        "output_tokens": output_tokens,
        "seconds": round(seconds, 3),
        "output_tok_per_s": round(output_tokens / seconds, 1),
        "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
        "device": info["device"],
        "dtype": info["dtype"],
        "kv_cache_dtype": info["kv_cache_dtype"],
        "max_total_tokens": info["max_total_tokens"],
        "radix_cache": not args.disable_radix_cache,
        "attention_backend": info["attention_backend"],
        "decode_attention": info["decode_attention"],
        "cuda_graph": not args.disable_cuda_graph,
        "overlap_schedule": not args.disable_overlap_schedule,
        "skinny_gemm_max_rows": args.skinny_gemm_max_rows,
    }
    if args.compare == "hf":
        from benchmarks.hf_baseline import hf_throughput

        # n samples of a prompt are n rows for transformers.
        rows = [(p, q) for p, q in zip(prompts, params) for _ in range(q.get("n", 1))]
        hf = hf_throughput(model, [p for p, _ in rows], [q for _, q in rows], args.hf_batch_size, args.dtype)
        result.update(hf, speedup=round(result["output_tok_per_s"] / hf["hf_output_tok_per_s"], 2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
