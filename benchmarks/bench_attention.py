"""Decode attention alone: time per layer call and achieved KV bandwidth, per kernel.

    python benchmarks/bench_attention.py --heads 16 --kv-heads 8 --batch 256 --context 1024

Lays a batch's KV out as the engine does (one [slots, kv_heads, head_dim] tensor each for K
and V, one token per slot, each request's slots scattered over the pool) and times one
layer's decode attention with CUDA events: FlashInfer's tensor-core decode (what the flashinfer
backend runs), FlashInfer's CUDA-core decode (GQA group sizes 1-4 and 8 only), and the Triton
kernel of the triton backend. Bandwidth = K and V bytes read / time. Prints one JSON line per
kernel; `--check` also compares each against the torch reference and a strided q (a view
into a fused qkv output) against a contiguous one. `--spread` draws each request's length
uniformly from [1, 2 x context] instead (a workload's mix), and `--long 2 32768` gives two
requests of the batch 32,768 keys each (a long tail among short requests); `--split-keys 64 1024` times the
Triton kernel once per piece length (keys per split-KV piece) instead of its default.
`--launch-context 32768` launches it as a graph sized for that context does (most programs of
a short request then find no keys).
`--kv-dtype fp8_e4m3` (or fp8_e5m2) keeps K and V in 8 bits, as kv_cache_dtype does, with bf16
queries. `--deterministic-configs` adds the deterministic mode's kernel (a decode as an extend
of one token per request).
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


def scattered_runs(lengths: list[int], run: int, device: torch.device) -> list[torch.Tensor]:
    """Slots 1 .. sum(lengths) dealt to requests of `lengths`: each request's tokens in runs of
    `run` adjacent slots (its last run shorter), the runs in random places of the pool."""
    pieces = [(i, min(run, n - s)) for i, n in enumerate(lengths) for s in range(0, n, run)]
    order = torch.randperm(len(pieces)).tolist()
    starts, at = [0] * len(pieces), 1
    for p in order:
        starts[p], at = at, at + pieces[p][1]
    slots: list[list[torch.Tensor]] = [[] for _ in lengths]
    for (i, size), start in zip(pieces, starts):
        slots[i].append(torch.arange(start, start + size))
    return [torch.cat(s).to(device) for s in slots]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--spread", action="store_true", help="lengths uniform in [1, 2 x context]")
    parser.add_argument(
        "--order", choices=("drawn", "longest-first", "shortest-first"), default="drawn",
        help="the batch's order of --spread lengths: as drawn, or sorted",
    )  # fmt: skip
    parser.add_argument(
        "--run", type=int, default=1,
        help="slots per contiguous run: each request's tokens lie in runs of this many adjacent "
        "slots, the runs scattered over the pool (1: every token scattered)",
    )  # fmt: skip
    parser.add_argument(
        "--long", type=int, nargs=2, metavar=("COUNT", "LENGTH"), default=None,
        help="COUNT requests at random places of the batch hold LENGTH keys each instead (a long "
        "tail among short requests: a kernel that gives each request one program waits on them)",
    )  # fmt: skip
    parser.add_argument("--kv-dtype", default="auto", help="auto (bf16), fp8_e4m3 or fp8_e5m2")
    parser.add_argument(
        "--flashinfer", nargs="*", choices=["tc", "tc-nosplit", "cuda-core"], default=["tc", "tc-nosplit", "cuda-core"],
        help="FlashInfer variants to time (each kv dtype and group size JIT-compiles its own modules)",
    )  # fmt: skip
    parser.add_argument("--split-keys", type=int, nargs="*", default=[], help="Triton piece lengths to time")
    parser.add_argument("--max-splits", type=int, default=None, help="Triton's most pieces a request is cut into")
    parser.add_argument(
        "--launch-context",
        type=int,
        default=None,
        help="launch the Triton kernel with the split count of this longest context, as a CUDA graph "
        "sized for it does (the engine's max context), instead of the batch's longest request's",
    )
    parser.add_argument(
        "--triton-configs", nargs="*", default=[],
        help="Triton launches to time, each BLOCK_N,num_warps,num_stages (e.g. 64,4,3 128,8,2)",
    )  # fmt: skip
    parser.add_argument(
        "--deterministic-configs", nargs="*", default=None,
        help="time the deterministic mode's kernel too: its default launch (no values) or each "
        "BLOCK_M,BLOCK_N,num_warps,num_stages given (e.g. 16,64,4,3)",
    )  # fmt: skip
    args = parser.parse_args()
    import flashinfer

    from rollout.forward.attention import AttentionShape
    from rollout.forward.attention.flashinfer_backend import workspace_bytes
    from rollout.forward.kv_pool import kv_cache_dtype, to_kv_dtype
    from rollout_kernels import decode_attention as triton_decode

    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    b, h, hkv, d, n = args.batch, args.heads, args.kv_heads, args.head_dim, args.context
    lengths = torch.randint(1, 2 * n + 1, (b,)).tolist() if args.spread else [n] * b
    if args.long is not None:
        count, length = args.long
        for i in torch.randperm(b)[:count].tolist():
            lengths[i] = length
    if args.order != "drawn":
        lengths.sort(reverse=args.order == "longest-first")
    slots_total = sum(lengths) + 1
    kv_dtype = kv_cache_dtype(args.kv_dtype, dtype)
    k_cache = to_kv_dtype(torch.randn(slots_total, hkv, d, dtype=dtype, device=dev), kv_dtype)
    v_cache = to_kv_dtype(torch.randn(slots_total, hkv, d, dtype=dtype, device=dev), kv_dtype)
    # Each request's slots scattered over the pool in runs of --run adjacent slots; slot 0 pads
    # the rows of shorter requests.
    perm = scattered_runs(lengths, args.run, dev)
    req_to_token = torch.zeros(b, max(lengths), dtype=torch.int64, device=dev)
    for i, slots in enumerate(perm):
        req_to_token[i, : lengths[i]] = slots
    seq_lens = torch.tensor(lengths, dtype=torch.int64, device=dev)
    rows = torch.arange(b, device=dev)
    qkv = torch.randn(b, (h + 2 * hkv) * d, dtype=dtype, device=dev)
    q_strided = qkv[:, : h * d].view(b, h, d)
    q = q_strided.contiguous()
    scale = d**-0.5
    kv_bytes = 2 * sum(lengths) * hkv * d * k_cache.element_size()

    indptr = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    indices = torch.cat(perm).to(torch.int32)
    last = torch.ones(b, dtype=torch.int32)
    cache = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))
    kernels = {}
    shape = AttentionShape(
        num_heads=h, num_kv_heads=hkv, head_dim=d, scaling=d**-0.5, dtype=dtype, device=dev,
        max_batch_size=b, max_context_len=max(lengths), kv_dtype=kv_dtype,
    )  # fmt: skip
    graph_workspace = workspace_bytes(shape, torch.cuda.get_device_properties(dev).multi_processor_count)
    variants = (
        ("flashinfer-tc", True, False),
        ("flashinfer-tc-nosplit", True, True),
        ("flashinfer-cuda-core", False, False),
    )
    for name, tensor_cores, no_split in variants:
        if name.removeprefix("flashinfer-") not in args.flashinfer:
            continue
        try:
            # As the engine's graph wrappers: plan arrays at fixed device addresses, and a
            # workspace sized as the engine sizes it for a graph of this batch (one for each
            # variant: the plans of all of them are alive at once here).
            workspace = torch.zeros(graph_workspace, dtype=torch.uint8, device=dev)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=indptr.to(dev), paged_kv_indices_buffer=indices.to(dev),
                paged_kv_last_page_len_buffer=last.to(dev), backend="fa2",
            )  # fmt: skip
            wrapper.plan(
                indptr, indices, last, h, hkv, d, 1, sm_scale=scale, q_data_type=dtype,
                kv_data_type=kv_dtype, disable_split_kv=no_split,
            )  # fmt: skip
            kernels[name] = (lambda w: lambda x: w.run(x, cache))(wrapper)
        except Exception as e:  # noqa: BLE001 - report which variant is unavailable
            print(json.dumps({"kernel": name, "error": str(e)[:200]}))
    def triton_kernel(split_keys: int | None, config: dict):
        def run(x: torch.Tensor) -> torch.Tensor:
            defaults = triton_decode.MIN_KEYS_PER_SPLIT, triton_decode.MAX_SPLITS
            if split_keys is not None:
                triton_decode.MIN_KEYS_PER_SPLIT = split_keys
            if args.max_splits is not None:
                triton_decode.MAX_SPLITS = args.max_splits
            try:
                splits = triton_decode.choose_num_splits(args.launch_context or max(lengths))
                return triton_decode.decode_attention(
                    x, k_cache, v_cache, req_to_token, rows, seq_lens, scale, splits, **config
                )
            finally:
                triton_decode.MIN_KEYS_PER_SPLIT, triton_decode.MAX_SPLITS = defaults

        return run

    configs = {"": {}}
    for text in args.triton_configs:
        block_n, warps, stages = text.split(",")
        configs[f"-n{block_n}w{warps}s{stages}"] = {
            "block_n": int(block_n), "num_warps": int(warps), "num_stages": int(stages),
        }  # fmt: skip
    for keys in args.split_keys or [None]:
        for suffix, config in configs.items():
            name = ("triton" if keys is None else f"triton-{keys}") + suffix
            kernels[name] = triton_kernel(keys, config)

    if args.deterministic_configs is not None:
        from rollout_kernels.deterministic_attention import deterministic_attention

        ones = torch.ones(b, dtype=torch.int64, device=dev)
        for text in args.deterministic_configs or [None]:
            config = None
            if text is not None:
                block_m, block_n, warps, stages = map(int, text.split(","))
                config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
            name = "deterministic" + ("" if text is None else f"-{text.replace(',', '-')}")
            kernels[name] = (lambda c: lambda x: deterministic_attention(
                x, k_cache, v_cache, req_to_token, rows, seq_lens, ones, rows, 1, scale, config=c,
            ))(config)  # fmt: skip

    ref = reference(q, k_cache, v_cache, req_to_token, lengths, scale) if args.check else None
    for name, fn in kernels.items():
        ms = time_ms(lambda fn=fn: fn(q))
        row = {
            "kernel": name, "batch": b, "context": n, "spread": args.spread, "order": args.order, "long": args.long, "run": args.run, "launch_context": args.launch_context, "heads": h, "kv_heads": hkv,
            "kv_dtype": str(kv_dtype).removeprefix("torch."),
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
