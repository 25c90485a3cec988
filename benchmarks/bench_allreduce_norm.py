"""The sum of a row-parallel projection's partial outputs with the residual add and RMSNorm after
it, at tensor parallelism N: FlashInfer's fused kernel (AllReduceNorm with a workspace) against
the group's NCCL all-reduce followed by the norm's own kernel. Prints one JSON line per row count.

    python benchmarks/bench_allreduce_norm.py --tp-size 2 --hidden 4096 --rows 2048 4096 8192 16384
    NCCL_MIN_NCHANNELS=32 python benchmarks/bench_allreduce_norm.py --symm-mem

--symm-mem adds torch's two-shot all-reduce over symmetric memory (peer loads over NVLink, no
multicast), the partial sums copied into the symmetric buffer first as a projection's output
would be written there (`symm_two_shot_ms` with the copy and the norm, `symm_alone_ms` the
all-reduce alone); where the op fails, `symm_error` says why. NCCL reads its settings from
the environment, which the ranks inherit.

One process per GPU. Each row count is timed eagerly (as a prefill runs, outside CUDA graphs),
the median over --iters calls on rank 0 (CUDA events around each call); `max_diff` is the
largest difference between the two paths' normed outputs on the same inputs (bf16).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench_tp_forward import free_port  # noqa: E402


def _median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rank(rank: int, args: argparse.Namespace, port: int, results) -> None:
    import torch.distributed as dist

    from rollout.forward.all_reduce_norm import AllReduceNorm
    from rollout.forward.tensor_parallel import TPGroup
    from rollout.models.layers import RMSNorm

    torch.cuda.set_device(rank)
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("nccl", init_method=url, rank=rank, world_size=args.tp_size)
    tp = TPGroup.from_group()
    dtype = torch.bfloat16
    fused = AllReduceNorm.flashinfer(tp, args.hidden, dtype, max_tokens=max(args.rows))
    apart = AllReduceNorm(tp)
    norm = RMSNorm(args.hidden, 1e-5).to("cuda", dtype)
    norm.fused = True  # the engine's Triton kernel
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    symm = _symm_buffer(max(args.rows), args.hidden, dtype) if args.symm_mem else None
    for rows in args.rows:
        gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
        x = torch.randn(rows, args.hidden, device="cuda", dtype=dtype, generator=gen)
        gen.manual_seed(7)  # the residual is the same on every rank
        residual = torch.randn(rows, args.hidden, device="cuda", dtype=dtype, generator=gen)
        line = _time_rows(tp, fused, apart, norm, x, residual, args, symm)
        if rank == 0:
            results.put(line)
    dist.barrier()
    dist.destroy_process_group()


def _time_rows(tp, fused, apart, norm, x, residual, args: argparse.Namespace, symm) -> dict:
    out_fused, _ = fused(x.clone(), residual, norm)
    out_apart, _ = apart(x.clone(), residual, norm)
    diff = (out_fused.float() - out_apart.float()).abs().max().item()
    # The unfused all-reduce sums in place: each call then sums the last one's sum, which
    # changes the values, not the work.
    work = x.clone()
    fused_ms = _median_ms(lambda: fused(x, residual, norm), args.iters)
    apart_ms = _median_ms(lambda: apart(work, residual, norm), args.iters)
    nccl_ms = _median_ms(lambda: tp.all_reduce(work), args.iters)
    rows = x.shape[0]
    line = {
        "bench": "allreduce_norm", "tp_size": args.tp_size, "hidden": args.hidden,
        "rows": rows, "mib": round(rows * args.hidden * 2 / 2**20, 1),
        "fused_ms": round(fused_ms, 4), "nccl_and_norm_ms": round(apart_ms, 4),
        "nccl_alone_ms": round(nccl_ms, 4), "max_diff": diff,
    }  # fmt: skip
    if isinstance(symm, str):
        line["symm_error"] = symm
    elif symm is not None:
        line.update(_symm_mem(symm[: x.shape[0]], x, residual, norm, out_apart, args.iters))
    return line


def _symm_buffer(rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor | str:
    """A [rows, hidden] buffer in symmetric memory, every rank together; where that fails,
    why (the other paths' numbers still count)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    try:
        buf = symm_mem.empty((rows, hidden), dtype=dtype, device="cuda")
        symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"[:300]
    return buf


def _symm_mem(buf, x, residual, norm, expected, iters: int) -> dict:
    """torch's two-shot all-reduce in symmetric memory (buf: x's rows of the buffer), then the
    norm; every rank together."""
    import torch.distributed as dist

    group_name = dist.group.WORLD.group_name

    def summed_norm():
        buf.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name)
        return norm.add_norm(buf, residual)

    try:
        out, _ = summed_norm()
        diff = (out.float() - expected.float()).abs().max().item()
        both_ms = _median_ms(summed_norm, iters)
        alone_ms = _median_ms(
            lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name), iters
        )
    except Exception as exc:  # noqa: BLE001 - reported, the other paths' numbers still count
        return {"symm_error": f"{type(exc).__name__}: {exc}"[:300]}
    return {
        "symm_two_shot_ms": round(both_ms, 4),
        "symm_alone_ms": round(alone_ms, 4),
        "symm_max_diff": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--symm-mem", action="store_true", help="add torch's two-shot all-reduce")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.tp_size:
        raise SystemExit(
            f"--tp-size {args.tp_size} needs as many GPUs; {torch.cuda.device_count()} visible"
        )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args, port, results)) for r in range(args.tp_size)]
    for proc in procs:
        proc.start()
    for _ in args.rows:
        print(json.dumps(results.get(timeout=600)), flush=True)
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"a rank exited with {proc.exitcode}")


if __name__ == "__main__":
    main()
