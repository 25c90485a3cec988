"""The deterministic mode's GEMM alone: torch's GEMM against the batch-invariant kernel, per
projection of a real model and per number of rows, and which tiling would serve each best.

    python benchmarks/bench_invariant_gemm.py --model qwen3-0.6b --rows 1 64 256
    python benchmarks/bench_invariant_gemm.py --model qwen2.5-7b --rows 1 64 --sweep

For each projection (q/k/v, o, gate/up, down, LM head) and row count, in bfloat16, inside CUDA
graphs with the weights read from HBM (bench_gemv's method): microseconds of
torch.nn.functional.linear and of rollout_kernels.batch_invariant_gemm with the engine's tiles
(gemm_tiles). With --sweep, also K summed in 2, 4 or 8 fixed pieces on programs of their own
(CHUNKINGS: more programs for few rows; whether that equals the pieces summed in one program,
bitwise, and is batch-invariant), and every tiling of TILINGS, the fastest named with whether
it is batch-invariant on the device: each row of a product of `rows` rows bitwise equal to the
same row multiplied alone, and within 2e-2 of torch. A tiling may depend on the weight's shape (it
is the same in every batch) but never on the rows: one tiling per projection, chosen over all
row counts, is what the engine could use.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench_attention import time_ms  # noqa: E402
from benchmarks.bench_gemv import COLD_BYTES, projections  # noqa: E402
from rollout.real_configs import REAL_CONFIGS  # noqa: E402

CHUNKINGS = [{"k_chunks": c, "split": True} for c in (2, 4, 8)]  # with the engine's tiles
TILINGS = [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
    for bm, bn, bk, w, st in itertools.product((16, 64), (32, 64, 128), (64, 128), (4,), (3, 4))
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(REAL_CONFIGS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--sweep", action="store_true", help="also time every tiling of TILINGS")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name, n, k, has_bias in projections(REAL_CONFIGS[args.model]):
        for rows in args.rows:
            row = {"model": args.model, "proj": name, "N": n, "K": k, "rows": rows}
            row.update(bench_projection(n, k, has_bias, rows, args.sweep))
            print(json.dumps(row), flush=True)


def bench_projection(n: int, k: int, has_bias: bool, rows: int, sweep: bool) -> dict:
    from rollout_kernels.batch_invariant_gemm import batch_invariant_linear, gemm_tiles

    dev, dtype = torch.device("cuda"), torch.bfloat16
    copies = max(2, -(-COLD_BYTES // (n * k * 2)))  # as bench_gemv: weights read from HBM
    ws = [torch.randn(n, k, dtype=dtype, device=dev) / k**0.5 for _ in range(copies)]
    b = torch.randn(n, dtype=dtype, device=dev) if has_bias else None
    x = torch.randn(rows, k, dtype=dtype, device=dev)
    turn = itertools.count()

    def timed(fn) -> float:
        return round(time_ms(fn, calls=4 * copies, replays=5) * 1000, 1)

    row = {
        "torch_us": timed(lambda: torch.nn.functional.linear(x, ws[next(turn) % copies], b)),
        "engine_us": timed(lambda: batch_invariant_linear(x, ws[next(turn) % copies], b)),
        "engine_tiles": gemm_tiles(dev, dtype),
    }
    if not sweep:
        return row
    for chunking in CHUNKINGS:  # K in fixed pieces on programs of their own (few rows)
        name = f"k_chunks_{chunking['k_chunks']}"
        row[f"{name}_us"] = timed(lambda c=chunking: batch_invariant_linear(x, ws[next(turn) % copies], b, **c))
        whole = batch_invariant_linear(x, ws[0], b, k_chunks=chunking["k_chunks"])
        row[f"{name}_split_equal"] = bool(torch.equal(batch_invariant_linear(x, ws[0], b, **chunking), whole))
        row[f"{name}_invariant"] = invariance(x, ws[0], b, None, k_chunks=chunking["k_chunks"])["invariant"]
    best = None
    for tiles in TILINGS:
        try:
            us = timed(lambda t=tiles: batch_invariant_linear(x, ws[next(turn) % copies], b, tiles=t))
        except Exception:  # noqa: BLE001 - a tiling that does not fit the device is skipped
            continue
        if best is None or us < best[0]:
            best = (us, tiles)
    if best is not None:
        us, tiles = best
        row.update({"best_us": us, "best_tiles": tiles, **invariance(x, ws[0], b, tiles)})
    return row


def invariance(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tiles: dict | None, k_chunks: int = 1
) -> dict:
    """Whether every row of x @ w.T under `tiles` (and `k_chunks`) equals that row's product
    alone (its pieces on programs of their own), bitwise, and the largest difference from
    torch's GEMM."""
    from rollout_kernels.batch_invariant_gemm import batch_invariant_linear

    full = batch_invariant_linear(x, w, b, tiles=tiles, k_chunks=k_chunks)
    alone = torch.cat([
        batch_invariant_linear(x[i : i + 1], w, b, tiles=tiles, k_chunks=k_chunks, split=True)
        for i in range(x.shape[0])
    ])  # fmt: skip
    err = (full.float() - torch.nn.functional.linear(x, w, b).float()).abs().max().item()
    return {"invariant": bool(torch.equal(full, alone)), "max_err_vs_torch": round(err, 4)}


if __name__ == "__main__":
    main()
