"""A decode step's projections with LoRA, its launches on the step's stream or beside the base GEMMs.

    python benchmarks/bench_lora_overlap.py --model qwen2.5-7b --rows 1 4 16

Every layer's four projection groups (q/k/v, o, gate/up, down), each its own weights (the step
reads them all from HBM, as a model's decode step does), their base GEMMs as the engine runs them
at a decode batch (the skinny GEMM where the weight is large enough and the batch is of at most
16 rows, else torch's), replayed from
one CUDA graph, one adapter slot of rank --rank on every row. The ways LoRA's shrink and expand
can run against the base GEMM, milliseconds a step:

- base: no LoRA;
- serial: the GEMM, then the shrink and the expand into its output (the engine's way);
- shrink_beside: the shrink on a second stream while the GEMM runs; the expand after both;
- delta_beside: the shrink and an expand into a zeroed delta on the second stream, the step's
  stream waiting for them only after its GEMM (the delta is left for the next kernel to add,
  as a norm or SiLU-and-mul could as it reads the output; that add is not timed here);
- planned: q/k/v as shrink_beside, o, gate/up and down as delta_beside.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench_attention import time_ms  # noqa: E402
from benchmarks.bench_lora_kernels import groups  # noqa: E402
from rollout.real_configs import REAL_CONFIGS  # noqa: E402

MODES = ("base", "serial", "shrink_beside", "delta_beside", "planned")
SKINNY_ROWS = 16  # the engine's skinny GEMM bound (KernelOptions.skinny_gemm_max_rows)


def step(mode, weights, xs, deltas, segments, ranks, r, rows, side) -> None:
    """One decode step's projections in `mode` (module docstring)."""
    from rollout.models.layers import linear
    from rollout_kernels.lora_expand import lora_expand
    from rollout_kernels.lora_shrink import lora_shrink

    main_stream = torch.cuda.current_stream()
    for layer in weights:
        for g, (w, a, b, scales, parts, skinny) in enumerate(layer):
            x = xs[g]
            way = mode if mode != "planned" else ("shrink_beside" if g == 0 else "delta_beside")
            if way in ("base", "serial"):
                out = linear(x, w, None, rows if skinny and rows <= SKINNY_ROWS else 0)
                if way == "serial":
                    y = lora_shrink(x, a, segments, ranks, r)
                    lora_expand(y, b, out, segments, ranks, scales, parts)
                continue
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                y = lora_shrink(x, a, segments, ranks, r)
                if way == "delta_beside":
                    deltas[g].zero_()
                    lora_expand(y, b, deltas[g], segments, ranks, scales, parts)
            out = linear(x, w, None, rows if skinny and rows <= SKINNY_ROWS else 0)
            main_stream.wait_stream(side)
            if way == "shrink_beside":
                lora_expand(y, b, out, segments, ranks, scales, parts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-7b", choices=sorted(REAL_CONFIGS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=9, help="adapter slots the buffers hold")
    parser.add_argument("--layers", type=int, default=0, help="0: the model's")
    args = parser.parse_args()
    from rollout.forward.kernel_plan import SKINNY_MIN_WEIGHT
    from rollout_kernels.lora_expand import OutputParts
    from rollout_kernels.lora_segments import lora_segments

    cfg = REAL_CONFIGS[args.model]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    layers = args.layers or cfg["num_hidden_layers"]
    torch.manual_seed(0)
    s, r = args.slots, args.rank
    ranks = torch.full((s,), r, dtype=torch.int32, device=dev)
    weights = []  # per layer, per group: (W, A, B, scales, parts, skinny)
    for _ in range(layers):
        layer = []
        for _name, sizes, k in groups(cfg):
            n, p = sum(sizes), len(sizes)
            w = torch.randn(n, k, dtype=dtype, device=dev) / k**0.5
            a = torch.randn(s, p * r, k, dtype=dtype, device=dev) / k**0.5
            b = torch.randn(s, n, r, dtype=dtype, device=dev) / r**0.5
            scales = torch.full((s, p), 2.0, dtype=torch.float32, device=dev)
            layer.append(
                (w, a, b, scales, OutputParts.make(sizes, dev), w.numel() >= SKINNY_MIN_WEIGHT)
            )
        weights.append(layer)
    side = torch.cuda.Stream()
    for rows in args.rows:
        segments = lora_segments(torch.zeros(rows, dtype=torch.int32, device=dev), s)
        xs = [torch.randn(rows, k, dtype=dtype, device=dev) for _, _, k in groups(cfg)]
        deltas = [
            torch.zeros(rows, sum(sizes), dtype=dtype, device=dev) for _, sizes, _ in groups(cfg)
        ]

        result = {"model": args.model, "rows": rows, "rank": r, "layers": layers}
        for mode in MODES:
            result[f"{mode}_ms"] = round(
                time_ms(
                    functools.partial(
                        step, mode, weights, xs, deltas, segments, ranks, r, rows, side
                    ),
                    calls=2,
                    replays=10,
                ),
                4,
            )
        base = result["base_ms"]
        for mode in MODES[1:]:
            result[f"{mode}_lora_ms"] = round(result[f"{mode}_ms"] - base, 4)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
