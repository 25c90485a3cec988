"""The deterministic mode's attention kernel alone, per launch config, on the shapes the engine
gives it: a decode (one new token per request), a prefill (every token new) and a chunk over
a cached prefix. One config serves every step of the mode (a token's bits depend on it), so
the one to pick is the fastest over all three.

    python benchmarks/bench_deterministic_attention.py --heads 16 --kv-heads 8 \\
        --configs 32,64,4,3 16,128,4,3 16,64,4,3

Each config as BLOCK_M,BLOCK_N,num_warps,num_stages; with none, the engine's default. The
shapes: --decode-batch requests with --context keys each and one new token; --prefill-batch
prompts of --prompt-len tokens; --chunk-batch requests extending a --context-key prefix by
--chunk-len tokens. Times with CUDA graphs as bench_attention does (GPU time per call);
prints one JSON line per shape and config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench_attention import time_ms  # noqa: E402


def shape_inputs(batch: int, prefix: int, new: int, heads: int, kv_heads: int, dim: int) -> dict:
    """The kernel's arguments for `batch` requests of `prefix` cached and `new` new tokens
    each, their slots shuffled over the pool."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    total = prefix + new
    slots = torch.randperm(batch * total, device=dev) + 1
    k_cache = torch.randn(batch * total + 1, kv_heads, dim, dtype=dtype, device=dev)
    v_cache = torch.randn_like(k_cache)
    return {
        "q": torch.randn(batch * new, heads, dim, dtype=dtype, device=dev),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "req_to_token": slots.view(batch, total),
        "req_pool_indices": torch.arange(batch, device=dev),
        "seq_lens": torch.full((batch,), total, device=dev),
        "extend_lens": torch.full((batch,), new, device=dev),
        "extend_starts": torch.arange(0, batch * new, new, device=dev),
        "max_extend_len": new,
        "sm_scale": dim**-0.5,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--decode-batch", type=int, default=256)
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--chunk-batch", type=int, default=16)
    parser.add_argument("--chunk-len", type=int, default=64)
    parser.add_argument("--configs", nargs="*", default=[], help="BLOCK_M,BLOCK_N,num_warps,num_stages")
    args = parser.parse_args()
    from rollout_kernels.deterministic_attention import deterministic_attention

    torch.manual_seed(0)
    dims = (args.heads, args.kv_heads, args.head_dim)
    shapes = {
        "decode": shape_inputs(args.decode_batch, args.context, 1, *dims),
        "prefill": shape_inputs(args.prefill_batch, 0, args.prompt_len, *dims),
        "chunk": shape_inputs(args.chunk_batch, args.context, args.chunk_len, *dims),
    }
    configs = {"default": None}
    for text in args.configs:
        block_m, block_n, warps, stages = map(int, text.split(","))
        configs[text] = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
    for shape, inputs in shapes.items():
        want = deterministic_attention(**inputs).float()
        for name, config in configs.items():
            fn = lambda c=config, i=inputs: deterministic_attention(**i, config=c)  # noqa: E731
            err = (fn().float() - want).abs().max().item()
            print(json.dumps({
                "shape": shape, "config": name, "us": round(time_ms(fn) * 1000, 1),
                "max_diff_vs_default": round(err, 4),
            }))  # fmt: skip


if __name__ == "__main__":
    main()
