"""Decode attention alone: time per layer call and achieved KV bandwidth, per kernel.

    python benchmarks/bench_attention.py --heads 16 --kv-heads 8 --batch 256 --context 1024

Lays a batch's KV out as the engine does (one [slots, kv_heads, head_dim] tensor each for K
and V, one token per slot, each request's slots scattered over the pool) and times one
layer's decode attention with CUDA events: FlashInfer's tensor-core decode (what the flashinfer
backend runs), FlashInfer's CUDA-core decode (GQA group sizes 1-4 and 8 only), and the Triton
kernel of the triton backend. Bandwidth = K and V bytes read / time. Prints one JSON line per
kernel; `--check` also compares each against the torch reference and a strided q (a view
into a fused qkv output) against a contiguous one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def time_ms(fn, calls: int = 20, replays: int = 10) -> float:
    """GPU time of one fn() call: `calls` calls captured in one CUDA graph (as the engine runs
    decode), replayed `replays` times, so host-side launch costs do not count."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (calls * replays)


def reference(q, k_cache, v_cache, slots, lengths, scale):
    out = []
    group = q.shape[1] // k_cache.shape[1]
    for b, (row, n) in enumerate(zip(slots, lengths)):
        k = k_cache[row[:n]].float().repeat_interleave(group, 1)  # [n, H, D]
        v = v_cache[row[:n]].float().repeat_interleave(group, 1)
        w = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", w.softmax(-1), v))
    return torch.stack(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    import flashinfer

    from rollout_kernels.decode_attention import choose_num_splits, decode_attention

    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    b, h, hkv, d, n = args.batch, args.heads, args.kv_heads, args.head_dim, args.context
    slots_total = b * n + 1
    k_cache = torch.randn(slots_total, hkv, d, dtype=dtype, device=dev)
    v_cache = torch.randn(slots_total, hkv, d, dtype=dtype, device=dev)
    perm = torch.randperm(slots_total - 1, device=dev) + 1
    req_to_token = perm.view(b, n)  # [B, context] int64
    lengths = [n] * b
    seq_lens = torch.full((b,), n, dtype=torch.int64, device=dev)
    rows = torch.arange(b, device=dev)
    qkv = torch.randn(b, (h + 2 * hkv) * d, dtype=dtype, device=dev)
    q_strided = qkv[:, : h * d].view(b, h, d)
    q = q_strided.contiguous()
    scale = d**-0.5
    kv_bytes = 2 * b * n * hkv * d * k_cache.element_size()

    indptr = torch.arange(0, (b + 1) * n, n, dtype=torch.int32)
    indices = req_to_token.reshape(-1).to(torch.int32)
    last = torch.ones(b, dtype=torch.int32)
    cache = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))
    kernels = {}
    variants = (
        ("flashinfer-tc", True, False),
        ("flashinfer-tc-nosplit", True, True),
        ("flashinfer-cuda-core", False, False),
    )
    for name, tensor_cores, no_split in variants:
        try:
            # As the engine's graph wrappers: plan arrays at fixed device addresses (and a
            # workspace of its own: the plans of all variants are alive at once here).
            workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=indptr.to(dev), paged_kv_indices_buffer=indices.to(dev),
                paged_kv_last_page_len_buffer=last.to(dev), backend="fa2",
            )  # fmt: skip
            wrapper.plan(
                indptr, indices, last, h, hkv, d, 1, sm_scale=scale, q_data_type=dtype,
                kv_data_type=dtype, disable_split_kv=no_split,
            )  # fmt: skip
            kernels[name] = (lambda w: lambda x: w.run(x, cache))(wrapper)
        except Exception as e:  # noqa: BLE001 - report which variant is unavailable
            print(json.dumps({"kernel": name, "error": str(e)[:200]}))
    splits = choose_num_splits(n)
    kernels["triton"] = lambda x: decode_attention(x, k_cache, v_cache, req_to_token, rows, seq_lens, scale, splits)

    ref = reference(q, k_cache, v_cache, req_to_token, lengths, scale) if args.check else None
    for name, fn in kernels.items():
        ms = time_ms(lambda fn=fn: fn(q))
        row = {
            "kernel": name, "batch": b, "context": n, "heads": h, "kv_heads": hkv,
            "us": round(ms * 1000, 1), "TB/s": round(kv_bytes / ms / 1e9, 3),
        }
        if args.check:
            out = fn(q).float()
            row["max_err"] = round((out - ref).abs().max().item(), 4)
            try:
                row["strided_q_equal"] = bool(torch.equal(fn(q_strided), fn(q)))
            except Exception as e:  # noqa: BLE001
                row["strided_q_equal"] = f"error: {str(e)[:120]}"
        print(json.dumps(row))


if __name__ == "__main__":
    main()
