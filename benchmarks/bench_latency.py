"""Batch-1 decode speed against the memory-bandwidth roofline: prints one JSON line.

    python benchmarks/bench_latency.py --model qwen2.5-7b --input-len 128 --output-len 128
    python benchmarks/bench_latency.py --model qwen3-0.6b --compare hf

A decode step of one request reads every weight once (the embedding table only for its one
row, unless the LM head shares it) plus the request's KV. Achieved bandwidth = those bytes /
step time, printed beside the device-to-device copy bandwidth measured here (bytes read +
written), which is what a memory-bound kernel can hope for. Step time comes from two runs of
the engine: (t(output_len tokens) - t(1 token)) / (output_len - 1), so prefill drops out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.hf_baseline import hf_generate_seconds, load_hf_model  # noqa: E402
from rollout import RolloutEngine  # noqa: E402
from rollout.config import CacheOptions, KernelOptions  # noqa: E402
from rollout.forward.kv_pool import kv_cache_dtype  # noqa: E402
from rollout.real_configs import REAL_CONFIGS, write_config_checkpoint  # noqa: E402


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * nbytes * iters / (time.perf_counter() - start)


def bytes_per_decode_step(
    model_path: str, dtype: torch.dtype, context: float, kv_dtype: torch.dtype | None = None
) -> tuple[int, int]:
    """(weight bytes, KV bytes) one batch-1 decode step reads at `context` tokens of KV held
    in kv_dtype (None: dtype)."""
    from transformers import AutoConfig

    from rollout.forward.kv_pool import KVPool
    from rollout.models.loader import build_model

    config = AutoConfig.from_pretrained(model_path)
    model = build_model(config, dtype, "meta")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if not getattr(config, "tie_word_embeddings", False):
        weights -= embed.numel() * embed.element_size()  # only one row of it is read
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = KVPool.bytes_per_token(config.num_hidden_layers, kv_heads, head_dim, kv_dtype or dtype)
    return weights, int(per_token * context)


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_timing(run, output_len: int, repeats: int, warmup_len: int) -> dict:
    """run(n) generates n tokens for the one prompt; returns prefill and per-step times."""
    run(warmup_len)
    first = timed(lambda: run(1), repeats)
    full = timed(lambda: run(output_len), repeats)
    step = (full - first) / (output_len - 1)
    return {"ttft_s": first, "total_s": full, "step_s": step}


def main() -> None:
    kernels, cache = KernelOptions(), CacheOptions()  # the engine's defaults
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", required=True, help=f"checkpoint dir or one of {sorted(REAL_CONFIGS)}"
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default=kernels.attention_backend)
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--disable-pdl", action="store_true", help="no programmatic dependent launch")
    parser.add_argument("--skinny-gemm-max-rows", type=int, default=kernels.skinny_gemm_max_rows)
    parser.add_argument("--kv-cache-dtype", default=cache.kv_cache_dtype, help="auto, fp8_e4m3 or fp8_e5m2")
    parser.add_argument("--triton-decode-max-batch", type=int, default=kernels.triton_decode_max_batch)
    parser.add_argument("--compare", choices=["hf"], help="also time transformers generate")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (one GPU each)")
    parser.add_argument("--enable-flashinfer-allreduce-fusion", action="store_true")
    args = parser.parse_args()
    if args.output_len < 2:
        parser.error(f"--output-len must be >= 2, got {args.output_len}")

    model = args.model
    options: dict = {
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
        "disable_cuda_graph": args.disable_cuda_graph,
        "disable_pdl": args.disable_pdl,
        "skinny_gemm_max_rows": args.skinny_gemm_max_rows,
        "kv_cache_dtype": args.kv_cache_dtype,
        "triton_decode_max_batch": args.triton_decode_max_batch,
        # Every run prefills the same prompt from scratch.
        "disable_radix_cache": True,
        "max_total_tokens": 8 * (args.input_len + args.output_len),
        "tp_size": args.tp_size,
        "enable_flashinfer_allreduce_fusion": args.enable_flashinfer_allreduce_fusion,
    }
    if not os.path.isdir(model):
        if model.lower() not in REAL_CONFIGS:
            parser.error(f"--model must be a checkpoint directory or one of {sorted(REAL_CONFIGS)}")
        model = write_config_checkpoint(model.lower(), tempfile.mkdtemp(prefix="rollout-bench-"))
        options["load_format"] = "dummy"
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    prompt = [(7 * i) % 10000 + 3 for i in range(args.input_len)]
    context = args.input_len + args.output_len / 2
    weight_bytes, kv_bytes = bytes_per_decode_step(model, dtype, context, kv_cache_dtype(args.kv_cache_dtype, dtype))
    copy_bw = copy_bandwidth(device)

    with RolloutEngine(model, **options) as engine:

        def run(n: int) -> None:
            params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": n}
            out = engine.generate(input_ids=prompt, sampling_params=params)
            assert out["meta_info"]["completion_tokens"] == n

        ours = decode_timing(run, args.output_len, args.repeats, args.output_len)
        info = engine.get_server_info()
    achieved = (weight_bytes + kv_bytes) / ours["step_s"]
    result = {
        "model": args.model,
        "batch": 1,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "attention_backend": args.attention_backend,
        "cuda_graph": not args.disable_cuda_graph,
        "pdl": info["kernel_plan"]["programmatic_launch"],
        "skinny_gemm_max_rows": args.skinny_gemm_max_rows,
        "triton_decode_max_batch": args.triton_decode_max_batch,
        "kv_cache_dtype": info["kv_cache_dtype"],
        "tp_size": info["tp_size"],
        "ttft_ms": round(ours["ttft_s"] * 1e3, 2),
        "decode_step_ms": round(ours["step_s"] * 1e3, 3),
        "decode_tok_per_s": round(1 / ours["step_s"], 1),
        "e2e_tok_per_s": round(args.output_len / ours["total_s"], 1),
        "weight_gib": round(weight_bytes / 2**30, 3),
        "kv_mib_per_step": round(kv_bytes / 2**20, 2),
        "achieved_tb_per_s": round(achieved / 1e12, 3),
        "copy_tb_per_s": round(copy_bw / 1e12, 3),
        "fraction_of_copy": round(achieved / copy_bw, 3),
        "device": torch.cuda.get_device_name(device),
        "engine_device": info["device"],
    }
    if args.compare == "hf":
        hf = load_hf_model(model, args.dtype)
        theirs = decode_timing(
            lambda n: hf_generate_seconds(hf, [prompt], [n], [{"temperature": 0}]),
            args.output_len,
            repeats=1,  # transformers is slow enough that one run is long and steady
            warmup_len=4,
        )
        result.update(
            hf_decode_tok_per_s=round(1 / theirs["step_s"], 1),
            hf_e2e_tok_per_s=round(args.output_len / theirs["total_s"], 1),
            decode_speedup=round(theirs["step_s"] / ours["step_s"], 2),
            e2e_speedup=round(theirs["total_s"] / ours["total_s"], 2),
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
