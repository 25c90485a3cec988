"""Offline throughput: prints one JSON line with output_tok_per_s.

    python benchmarks/bench_offline.py --model qwen3-0.6b --workload nano
    python benchmarks/bench_offline.py --model /path/to/ckpt --workload grpo --num-seqs 8 \\
        --max-len 64
    python benchmarks/bench_offline.py --model qwen2.5-7b --workload fixed --num-seqs 64 \\
        --max-len 256 --compare hf
    python benchmarks/bench_offline.py --model llama-3.1-8b --workload random --num-seqs 500 \\
        --input-len 4096 --output-len 2048

On a CPU, with the project's tiny model (seconds):

    rollout tiny-model /tmp/rollout-tiny
    python benchmarks/bench_offline.py --model /tmp/rollout-tiny --workload nano --num-seqs 4 \\
        --max-len 100

`nano` is the nano-vllm workload (256 sequences, input and output lengths uniform in
100..1024, `random.seed(0)`, prompts drawn before output lengths, token ids randint(0, 10000),
temperature 0.6, ignore_eos). `grpo` is 64 prompts of 64..512 tokens x n=8 samples of --max-len
tokens. `fixed` is num_seqs greedy requests of exactly max_len prompt and max_len output tokens
(or --input-len / --output-len). `random` is SGLang's random dataset as its CI benchmarks it
(`bench_serving --dataset-name random`, range ratio 0): prompt lengths uniform in
[1, input_len] and output lengths uniform in [1, output_len] (`--range-ratio r` raises both
lower bounds to r x the length), ignore_eos, greedy. Token ids are drawn in 0..10000 and taken
modulo the model's vocabulary (config.json's vocab_size), so a model with a larger one sees
exactly nano-vllm's prompts and a smaller one still gets valid ids. A prompt and its output must
fit the model's context together; lengths that cannot are refused before the engine starts.

A NAME of a real model (see REAL_CONFIGS) runs its real config with random weights (speed does
not depend on them). `--compare hf` then runs transformers `generate` on the same model and
prompts in this process (after the engine has shut down, on a GPU), in left-padded batches of
--hf-batch-size, and prints the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout import RolloutEngine  # noqa: E402
from rollout.config import CacheOptions, KernelOptions  # noqa: E402
from rollout.real_configs import REAL_CONFIGS, write_config_checkpoint  # noqa: E402

Workload = tuple[list[list[int]], list[dict]]
TOKEN_ID_HIGH = 10000  # nano-vllm draws randint(0, 10000)
NANO_MIN_LEN = 100  # nano-vllm's prompt and output lengths are uniform in 100..max_len
GRPO_PROMPT_LENS = (64, 512)
DEFAULT_NUM_SEQS = {"nano": 256, "grpo": 64, "fixed": 64, "random": 500}
DEFAULT_MAX_LEN = {"nano": 1024, "grpo": 512, "fixed": 256, "random": 1024}


def token_ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    # Drawn as nano-vllm does, then folded into the vocabulary: the random stream (and with it
    # every later length) is the same whatever the model.
    return [rng.randint(0, TOKEN_ID_HIGH) % vocab_size for _ in range(count)]


def nano_workload(num_seqs: int, max_len: int, vocab_size: int) -> Workload:
    rng = random.Random(0)
    prompts = [
        token_ids(rng, rng.randint(NANO_MIN_LEN, max_len), vocab_size) for _ in range(num_seqs)
    ]
    params = [
        {"temperature": 0.6, "ignore_eos": True, "max_new_tokens": output_len}
        for output_len in (rng.randint(NANO_MIN_LEN, max_len) for _ in range(num_seqs))
    ]
    return prompts, params


def grpo_workload(num_prompts: int, output_len: int, vocab_size: int) -> Workload:
    rng = random.Random(0)
    prompts = [
        token_ids(rng, rng.randint(*GRPO_PROMPT_LENS), vocab_size) for _ in range(num_prompts)
    ]
    params = [
        {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": output_len, "n": 8}
        for _ in range(num_prompts)
    ]
    return prompts, params


def fixed_workload(num_seqs: int, input_len: int, output_len: int, vocab_size: int) -> Workload:
    rng = random.Random(0)
    prompts = [token_ids(rng, input_len, vocab_size) for _ in range(num_seqs)]
    params = [
        {"temperature": 0, "ignore_eos": True, "max_new_tokens": output_len}
        for _ in range(num_seqs)
    ]
    return prompts, params


def random_workload(
    num_seqs: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int
) -> Workload:
    rng = random.Random(0)
    prompts, params = [], []
    for _ in range(num_seqs):
        n_in = rng.randint(max(int(input_len * range_ratio), 1), input_len)
        n_out = rng.randint(max(int(output_len * range_ratio), 1), output_len)
        prompts.append(token_ids(rng, n_in, vocab_size))
        params.append({"temperature": 0, "ignore_eos": True, "max_new_tokens": n_out})
    return prompts, params


def build_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """args as resolve_lengths left them."""
    if args.workload == "nano":
        return nano_workload(args.num_seqs, args.max_len, vocab_size)
    if args.workload == "grpo":
        return grpo_workload(args.num_seqs, args.output_len, vocab_size)
    if args.workload == "random":
        return random_workload(
            args.num_seqs, args.input_len, args.output_len, args.range_ratio, vocab_size
        )
    return fixed_workload(args.num_seqs, args.input_len, args.output_len, vocab_size)


def resolve_lengths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills in the workload's defaults and refuses lengths it cannot draw from (with
    parser.error: exit status 2 and a message naming the flag). Afterwards args.input_len and
    args.output_len are the longest prompt and output the workload can make."""
    w = args.workload
    for flag in ("num_seqs", "max_len", "input_len", "output_len", "hf_batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if not 0 <= args.range_ratio <= 1:
        parser.error(f"--range-ratio must be in [0, 1], got {args.range_ratio}")
    if w != "random" and args.range_ratio:
        parser.error(f"--range-ratio applies to --workload random only, not {w}")
    if w in ("nano", "grpo") and (args.input_len or args.output_len):
        parser.error(f"--input-len and --output-len apply to --workload fixed and random; {w} "
                     "takes --max-len")  # fmt: skip
    args.num_seqs = args.num_seqs or DEFAULT_NUM_SEQS[w]
    args.max_len = args.max_len or DEFAULT_MAX_LEN[w]
    if w == "nano":
        if args.max_len < NANO_MIN_LEN:
            parser.error(
                f"--max-len must be >= {NANO_MIN_LEN} for --workload nano (its prompt and output "
                f"lengths are uniform in {NANO_MIN_LEN}..max-len), got {args.max_len}"
            )
        args.input_len = args.output_len = args.max_len
    elif w == "grpo":
        args.input_len, args.output_len = GRPO_PROMPT_LENS[1], args.max_len
    else:
        args.input_len = args.input_len or args.max_len
        args.output_len = args.output_len or args.max_len


def check_context(
    parser: argparse.ArgumentParser, args: argparse.Namespace, context: int, source: str
) -> None:
    """A prompt and its output must fit the context together (else the engine cuts the output
    short or refuses the prompt)."""
    total = args.input_len + args.output_len
    if total <= context:
        return
    flags = {
        "nano": f"--max-len {args.max_len}",
        "grpo": f"--max-len {args.max_len} (prompts are up to {GRPO_PROMPT_LENS[1]} tokens)",
    }.get(args.workload, f"--input-len {args.input_len} / --output-len {args.output_len}")
    parser.error(
        f"--workload {args.workload} with {flags} makes prompts of up to {args.input_len} and "
        f"outputs of up to {args.output_len} tokens, {total} in all, over the model's context "
        f"of {context} tokens ({source}); lower the lengths"
    )


def read_config(parser: argparse.ArgumentParser, model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        parser.error(f"--model {model_dir}: cannot read a checkpoint's config.json ({e})")
    # Multimodal checkpoints keep the language model's sizes under text_config.
    text = {**config.get("text_config", {}), **config}
    if not isinstance(text.get("vocab_size"), int):
        parser.error(f"--model {model_dir}: config.json has no vocab_size")
    return text


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    kernels, cache = KernelOptions(), CacheOptions()  # the engine's defaults
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", "--model-path", dest="model", required=True,
        help=f"checkpoint dir or one of {sorted(REAL_CONFIGS)}")  # fmt: skip
    add("--workload", choices=["nano", "grpo", "fixed", "random"], default="nano")
    add("--num-seqs", type=int,
        help="sequences (nano 256, fixed 64, random 500) or prompts (grpo, 64)")  # fmt: skip
    add("--max-len", type=int,
        help="nano: max prompt and output length (1024, at least 100); grpo: output length "
        "(512); fixed and random: default of --input-len and --output-len (256, 1024)")  # fmt: skip
    add("--input-len", type=int, help="fixed: prompt length; random: max prompt length")
    add("--output-len", type=int, help="fixed: output length; random: max output length")
    add("--range-ratio", type=float, default=0.0,
        help="random: lower bound of the lengths, as a fraction of them, in [0, 1]")  # fmt: skip
    add("--dtype", default="auto")
    add("--device", default=None)
    add("--disable-radix-cache", action="store_true")
    add("--max-total-tokens", type=int)
    add("--attention-backend", default=kernels.attention_backend)
    add("--disable-cuda-graph", action="store_true")
    add("--disable-overlap-schedule", action="store_true")
    add("--compare", choices=["hf"], help="also time transformers generate (GPU)")
    add("--hf-batch-size", type=int, default=64)
    add("--kv-cache-dtype", default=cache.kv_cache_dtype, help="auto, fp8_e4m3 or fp8_e5m2")
    add("--skinny-gemm-max-rows", type=int, default=kernels.skinny_gemm_max_rows)
    add("--triton-decode-max-batch", type=int, default=kernels.triton_decode_max_batch)
    add("--tp-size", type=int, default=1, help="tensor-parallel ranks (one GPU each)")
    args = parser.parse_args()
    resolve_lengths(parser, args)
    if args.compare == "hf" and not torch.cuda.is_available():
        parser.error("--compare hf needs a CUDA GPU (hf_baseline.py runs transformers there)")
    return parser, args


def main() -> None:
    parser, args = parse_args()
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
        "tp_size": args.tp_size,
    }
    if args.max_total_tokens:
        options["max_total_tokens"] = args.max_total_tokens
    model = args.model
    if not os.path.isdir(model):
        if model.lower() not in REAL_CONFIGS:
            parser.error(f"--model must be a checkpoint directory or one of {sorted(REAL_CONFIGS)}")
        model = write_config_checkpoint(model.lower(), tempfile.mkdtemp(prefix="rollout-bench-"))
        options["load_format"] = "dummy"

    config = read_config(parser, model)
    # The engine's default context (scheduler_process.py); the exact one is checked once it runs.
    context = config.get("max_position_embeddings", 4096)
    check_context(parser, args, context, "max_position_embeddings in config.json")
    prompts, params = build_workload(args, config["vocab_size"])
    expected_tokens = sum(p["max_new_tokens"] * p.get("n", 1) for p in params)

    with RolloutEngine(model, **options) as engine:
        # Smaller than the config's when the KV pool (--max-total-tokens) is.
        context = engine.get_server_info()["context_length"]
        check_context(parser, args, context, "the engine's context_length")
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
    if output_tokens != expected_tokens:
        raise RuntimeError(
            f"the engine generated {output_tokens} tokens, the workload asked for "
            f"{expected_tokens} (ignore_eos): a request was cut short or aborted"
        )
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
        "tp_size": info["tp_size"],
        "decode_attention": info["decode_attention"],
        "cuda_graph": not args.disable_cuda_graph and info["device"].startswith("cuda"),
        "overlap_schedule": not args.disable_overlap_schedule,
        "skinny_gemm_max_rows": args.skinny_gemm_max_rows,
    }
    if args.compare == "hf":
        from benchmarks.hf_baseline import hf_throughput

        # n samples of a prompt are n rows for transformers.
        rows = [(p, q) for p, q in zip(prompts, params) for _ in range(q.get("n", 1))]
        hf = hf_throughput(
            model, [p for p, _ in rows], [q for _, q in rows], args.hf_batch_size, args.dtype
        )
        result.update(hf, speedup=round(result["output_tok_per_s"] / hf["hf_output_tok_per_s"], 2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
