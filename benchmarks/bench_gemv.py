"""A small decode batch's linear layers alone: torch's GEMM against the skinny GEMM kernel.

    python benchmarks/bench_gemv.py --model qwen2.5-7b --rows 1 [--tp-size 2]

For each projection of the model (q/k/v, o, gate/up, down, LM head), in bfloat16, times
torch.nn.functional.linear and rollout_kernels.skinny_gemm over a few tile configurations,
inside CUDA graphs (as decode runs) with the weights read from HBM rather than the L2 cache,
and prints one JSON line per projection: microseconds and the weight bytes read per second of
each, the best configuration (`skinny_*`), the engine's tiles (SKINNY_GEMM_TILES), and the best
one's largest error against torch; and the same with the features split evenly over one or two
programs an SM (`balanced_*`; its config: programs, block_k, num_warps, num_stages). With
--tp-size, one rank's shards: q/k/v, gate/up and the LM head split by output features, o and
down by input features.
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
from rollout.models.layers import SKINNY_GEMM_TILES  # noqa: E402
from rollout.real_configs import REAL_CONFIGS  # noqa: E402

COLD_BYTES = 256 << 20  # weights cycled through per projection
CONFIGS = [*itertools.product((16, 32, 64), (256, 512), (4,), (3, 5)), (32, 512, 8, 4), (64, 512, 8, 4)]
# The features split evenly over (SMs x waves) programs (skinny_gemm's `programs`), by block_k,
# num_warps and num_stages.
BALANCED = list(itertools.product((1, 2), (256, 512), (4, 8), (3, 4)))


PROJECTIONS = ["qkv", "o", "gate_up", "down", "lm_head"]
ROW_PARALLEL = ("o", "down")  # split by input features at tensor parallelism


def projections(cfg: dict, tp: int = 1) -> list[tuple[str, int, int, bool]]:
    """(name, out features, in features, bias) of one layer's linear layers and the LM head,
    as one rank of `tp` holds them."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads", heads)
    qkv_bias = cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias"))
    inter = cfg["intermediate_size"]
    whole = [
        ("qkv", (heads + 2 * kv) * head_dim, hidden, qkv_bias),
        ("o", hidden, heads * head_dim, False),
        ("gate_up", 2 * inter, hidden, False),
        ("down", hidden, inter, False),
        ("lm_head", cfg["vocab_size"], hidden, False),
    ]
    return [
        (name, n, k // tp, bias) if name in ROW_PARALLEL else (name, -(-n // tp), k, bias)
        for name, n, k, bias in whole
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", choices=sorted(REAL_CONFIGS))
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1, help="one rank's shards at this tp")
    parser.add_argument("--proj", nargs="+", choices=PROJECTIONS, default=PROJECTIONS, help="these projections only")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name, n, k, has_bias in projections(REAL_CONFIGS[args.model], args.tp_size):
        if name not in args.proj:
            continue
        row = {"model": args.model, "rows": args.rows, "tp": args.tp_size, "proj": name, "N": n, "K": k}
        row.update(bench_projection(n, k, has_bias, args.rows))
        print(json.dumps(row))


def bench_projection(n: int, k: int, has_bias: bool, rows: int) -> dict:
    from rollout_kernels.skinny_gemm import skinny_gemm

    dev, dtype = torch.device("cuda"), torch.bfloat16
    # As in a forward, every call reads its weight from HBM: the calls captured in a graph cycle
    # through enough copies that none is still in the L2 cache (50 MiB on an H100).
    copies = max(2, -(-COLD_BYTES // (n * k * 2)))
    ws = [torch.randn(n, k, dtype=dtype, device=dev) / k**0.5 for _ in range(copies)]
    b = torch.randn(n, dtype=dtype, device=dev) if has_bias else None
    x = torch.randn(rows, k, dtype=dtype, device=dev)
    nbytes = n * k * 2
    want = torch.nn.functional.linear(x, ws[0], b).float()
    turn = itertools.count()

    def torch_linear():
        return torch.nn.functional.linear(x, ws[next(turn) % copies], b)

    torch_ms = time_ms(torch_linear, calls=4 * copies, replays=5)
    row = {"torch_us": round(torch_ms * 1000, 1), "torch_TB/s": round(nbytes / torch_ms / 1e9, 3)}

    def skinny(weight=None, **launch):
        weight = ws[next(turn) % copies] if weight is None else weight
        return skinny_gemm(x, weight, b, **launch)

    engine_ms = time_ms(lambda: skinny(**SKINNY_GEMM_TILES), calls=4 * copies, replays=5)
    row["engine_tiles_us"] = round(engine_ms * 1000, 1)

    def search(configs: list[dict]) -> tuple[float, dict, float] | None:
        """(ms, launch, largest error against torch) of the fastest launch in `configs`."""
        best = None
        for launch in configs:
            try:
                ms = time_ms(lambda launch=launch: skinny(**launch), calls=4 * copies, replays=5)
            except Exception:  # noqa: BLE001 - a tile that does not fit is skipped
                continue
            if best is None or ms < best[0]:
                err = (skinny(weight=ws[0], **launch).float() - want).abs().max().item()
                best = (ms, launch, err)
        return best

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tiles = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st) for bn, bk, w, st in CONFIGS]
    # A share wider than 128 features is a tile too large to compile quickly or run well.
    balanced = [
        dict(programs=waves * sms, block_k=bk, num_warps=w, num_stages=st)
        for waves, bk, w, st in BALANCED if -(-n // (waves * sms)) <= 128
    ]  # fmt: skip
    for prefix, configs in (("skinny", tiles), ("balanced", balanced)):
        if (best := search(configs)) is not None:
            ms, launch, err = best
            row.update({
                f"{prefix}_us": round(ms * 1000, 1), f"{prefix}_TB/s": round(nbytes / ms / 1e9, 3),
                f"{prefix}_config": tuple(launch.values()), f"{prefix}_max_err": round(err, 4),
            })  # fmt: skip
    return row


if __name__ == "__main__":
    main()
