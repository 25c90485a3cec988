"""The LoRA kernels alone, per projection group of a real model: shrink and expand as a decode
step runs them, and which launch settings would serve each best.

    python benchmarks/bench_lora_kernels.py --model qwen2.5-7b --rows 1 64

For each group (q/k/v, o, gate/up, down) and row count, in bfloat16, inside CUDA graphs: rows
spread over --adapters slots of ranks --ranks (max rank --max-rank, as the engine's slots hold
them), microseconds of rollout_kernels.lora_shrink + lora_expand with the engine's settings (the
kernels' defaults: shrink_settings and expand_settings for the row count, named in the line), of
each alone, and, with --sweep, the fastest shrink of SHRINK_SETTINGS (split_k None:
choose_split_k's, uncapped) beside the engine's expand, the fastest expand of EXPAND_SETTINGS
beside the engine's shrink, and the two fastest together, with their largest difference from
the engine's settings' result (with --all-settings also every setting's time, to pick one
setting for all groups of a row count). One JSON line per group and row count. By default each
call reads the same A and B, which stay in L2; with --cold-l2-mib the calls take turns over
copies of them, read from HBM as in an engine's step.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench_attention import time_ms  # noqa: E402
from rollout.real_configs import REAL_CONFIGS  # noqa: E402

SHRINK_SETTINGS = [
    {"split_k": sk, "block_n": bn, "block_k": bk}
    for sk, bn, bk in itertools.product((None, 1, 4), (16, 32, 64), (64, 128, 256))
]
EXPAND_SETTINGS = [
    {"block_n": bn, "num_warps": w, "n_tiles": t, "num_stages": st}
    for bn, w, t, st in itertools.product((64, 128, 256), (4, 8), (1, 2, 4, 8), (2, 3))
]


def groups(cfg: dict) -> list[tuple[str, list[int], int]]:
    """(name, output sizes of its projections, input features) of one layer's LoRA groups."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads", heads) * head_dim
    inter = cfg["intermediate_size"]
    return [
        ("qkv", [heads * head_dim, kv, kv], hidden),
        ("o", [hidden], heads * head_dim),
        ("gate_up", [inter, inter], hidden),
        ("down", [hidden], inter),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", choices=sorted(REAL_CONFIGS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--max-rank", type=int, default=64)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--all-settings", action="store_true",
        help="with --sweep, every setting's time (to pick one setting for all groups of a row count)",
    )  # fmt: skip
    parser.add_argument(
        "--cold-l2-mib", type=int, default=0,
        help="cycle each call through copies of A and B of at least this many MiB in all, so that "
        "they come from HBM as in a decode step, where the layers' weights pass between them "
        "(an H100's L2 holds 50 MB: 256 is enough); 0: the same A and B every call, L2-resident",
    )  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(0)
    for name, sizes, k in groups(REAL_CONFIGS[args.model]):
        for rows in args.rows:
            row = {"model": args.model, "group": name, "rows": rows, "adapters": args.adapters}
            row.update(bench_group(sizes, k, rows, args))
            print(json.dumps(row), flush=True)


def setting_key(setting: dict) -> str:
    """A swept setting as text ("engine" for the engine's own), e.g. "block_n=64,num_warps=4"."""
    return ",".join(f"{k}={v}" for k, v in setting.items()) or "engine"


def bench_group(sizes: list[int], k: int, rows: int, args: argparse.Namespace) -> dict:
    from rollout_kernels.lora_expand import OutputParts, expand_settings, lora_expand
    from rollout_kernels.lora_segments import lora_segments
    from rollout_kernels.lora_shrink import choose_split_k, lora_shrink, shrink_settings

    dev, dtype = torch.device("cuda"), torch.bfloat16
    s, p, r, n = args.adapters + 1, len(sizes), args.max_rank, sum(sizes)  # +1: the engine's spare slot
    a = torch.randn(s, p * r, k, dtype=dtype, device=dev) / k**0.5
    b = torch.randn(s, n, r, dtype=dtype, device=dev) / r**0.5
    ranks = torch.tensor([args.ranks[i % len(args.ranks)] for i in range(s)], dtype=torch.int32, device=dev)
    scales = torch.full((s, p), 2.0, dtype=torch.float32, device=dev)
    parts = OutputParts.make(sizes, dev)
    slots = torch.arange(rows, device=dev) % args.adapters  # every adapter in turn; one row: slot 0
    segments = lora_segments(slots, s)
    x = torch.randn(rows, k, dtype=dtype, device=dev)
    start = torch.randn(rows, n, dtype=dtype, device=dev)
    out = start.clone()  # added to by every timed call; reset before each comparison
    copies = -(-args.cold_l2_mib * 2**20 // (a.nbytes + b.nbytes))
    weights = [(a, b)] + [(a.clone(), b.clone()) for _ in range(copies - 1)]
    turn = itertools.count()  # each call (each captured one too) takes the next copy

    def next_weights() -> tuple[torch.Tensor, torch.Tensor]:
        return weights[next(turn) % len(weights)]

    def both(shrink: dict, expand: dict) -> torch.Tensor:
        if shrink.get("split_k", 0) is None:  # the sweep's None: choose_split_k's, uncapped
            # bf16 and K past block_k: lora_shrink would pass choose_split_k these same blocks
            auto = choose_split_k(segments, p * r, k, shrink["block_n"], shrink["block_k"])
            shrink = {**shrink, "split_k": auto}
        a_, b_ = next_weights()
        y = lora_shrink(x, a_, segments, ranks, r, **shrink)
        return lora_expand(y, b_, out, segments, ranks, scales, parts, **expand)

    def us(fn) -> float:
        return round(time_ms(fn, calls=20, replays=5) * 1000, 1)

    y = lora_shrink(x, a, segments, ranks, r)
    # The adapter bytes the two kernels must read: A's and B's rows within the rank of each
    # slot that has rows (the buffers hold max_rank; the kernels skip what is past a rank).
    need = sum(int(ranks[u]) * (p * k + n) * a.element_size() for u in set(slots.tolist()))
    row = {
        "engine_shrink": dataclasses.asdict(shrink_settings(rows)),
        "engine_expand": dataclasses.asdict(expand_settings(rows)),
        "engine_us": us(lambda: both({}, {})),
        "shrink_us": us(lambda: lora_shrink(x, next_weights()[0], segments, ranks, r)),
        "expand_us": us(
            lambda: lora_expand(y, next_weights()[1], out, segments, ranks, scales, parts)
        ),
        "split_k": y.shape[0],
        "weight_copies": len(weights),
        "adapter_mb": round(need / 1e6, 2),
    }
    row["adapter_tb_per_s"] = round(need / row["engine_us"] / 1e6, 3)  # those bytes / the time
    if not args.sweep:
        return row
    out.copy_(start)
    want = both({}, {}).float() - start.float()  # the delta the engine's settings add
    timings: dict[str, float] = {}  # every setting swept: "shrink|expand" -> µs

    def fastest(pairs):
        best = None
        for shrink, expand in pairs:
            try:
                t = us(lambda sh=shrink, ex=expand: both(sh, ex))
            except Exception:  # noqa: BLE001 - a setting that does not fit the device is skipped
                continue
            timings[f"{setting_key(shrink)}|{setting_key(expand)}"] = t
            if best is None or t < best[0]:
                best = (t, shrink, expand)
        return best

    # The two kernels' settings are swept apart (the shrink's split_k only changes how many
    # partials the expand adds), then the two winners run together.
    by_shrink = fastest((sh, {}) for sh in SHRINK_SETTINGS)
    by_expand = fastest(({}, ex) for ex in EXPAND_SETTINGS)
    if by_shrink is None or by_expand is None:
        return row
    shrink, expand = by_shrink[1], by_expand[2]
    out.copy_(start)
    err = ((both(shrink, expand).float() - start.float()) - want).abs().max().item()
    row.update({
        "best_shrink": shrink, "best_shrink_us": by_shrink[0],
        "best_expand": expand, "best_expand_us": by_expand[0],
        "best_us": us(lambda: both(shrink, expand)), "max_diff": round(err, 4),
    })  # fmt: skip
    if args.all_settings:
        row["sweep_us"] = timings
    return row


if __name__ == "__main__":
    main()
