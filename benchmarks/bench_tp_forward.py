"""The decode forward alone, at tensor parallelism N: prints one JSON line.

    python benchmarks/bench_tp_forward.py --model qwen2.5-7b --tp-size 1
    python benchmarks/bench_tp_forward.py --model qwen2.5-7b --tp-size 2
    python benchmarks/bench_tp_forward.py --model qwen2.5-7b --tp-size 2 --no-collectives

Each rank (one process per GPU) builds the engine's own ModelRunner (the real config's shapes,
random bf16 weights) and replays its CUDA graph of a --batch decode step, with nothing around
it: no scheduler, no step messages between ranks, no sampling. The milliseconds per replay (CUDA
events on rank 0) are the device's share of a step; bench_latency.py's decode step less this is
the host's. --no-collectives replaces the all-reduce and all-gather with local stand-ins of the
same shapes (wrong numbers, right kernels otherwise): the collectives' share.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rollout.real_configs import REAL_CONFIGS, write_config_checkpoint  # noqa: E402

WARMUP = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_collectives() -> None:
    from rollout.forward.tensor_parallel import TPGroup

    TPGroup.all_reduce = lambda self, x: x
    TPGroup.all_gather = lambda self, x, dim=-1: torch.cat([x] * self.size, dim=dim)


def _rank(rank: int, args: argparse.Namespace, path: str, port: int, results) -> None:
    import torch.distributed as dist
    from transformers import AutoConfig

    from rollout.config import EngineOptions
    from rollout.engine.cuda_graph_runner import padded_size
    from rollout.engine.model_runner import ModelRunner
    from rollout.forward.tensor_parallel import SINGLE, TPGroup

    torch.cuda.set_device(rank)
    tp = SINGLE
    if args.tp_size > 1:
        url = f"tcp://127.0.0.1:{port}"
        dist.init_process_group("nccl", init_method=url, rank=rank, world_size=args.tp_size)
        tp = TPGroup.from_group()
    if args.no_collectives:
        _no_collectives()
    options = EngineOptions.from_kwargs(
        model_path=path, load_format="dummy", dtype="bfloat16", device=f"cuda:{rank}",
        tp_size=args.tp_size, max_total_tokens=16384, cuda_graph_max_bs=args.batch,
        attention_backend=args.attention_backend,
        enable_flashinfer_allreduce_fusion=args.enable_flashinfer_allreduce_fusion,
    )  # fmt: skip
    config = AutoConfig.from_pretrained(path)
    runner = ModelRunner(options, config, config.max_position_embeddings, [], tp)
    graphs = runner.graph_runner
    graph = graphs.graphs[padded_size(graphs.sizes, args.batch)]
    for _ in range(WARMUP):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    results.put((rank, start.elapsed_time(end) / args.iters))
    if args.tp_size > 1:
        dist.barrier()
    # Without destroy_process_group: with CUDA graphs that captured its collectives still
    # alive it blocked (and the engine's ranks never call it either); exiting frees it all.
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", choices=sorted(REAL_CONFIGS))
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--no-collectives", action="store_true")
    parser.add_argument("--enable-flashinfer-allreduce-fusion", action="store_true")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.tp_size:
        parser.error(f"--tp-size {args.tp_size} needs as many GPUs, found {torch.cuda.device_count()}")
    path = write_config_checkpoint(args.model, tempfile.mkdtemp(prefix=f"rollout-{args.model}-"))
    ctx, port = mp.get_context("spawn"), _free_port()
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, path, port, results)) for r in range(args.tp_size)]
    for p in procs:
        p.start()
    times = dict(results.get(timeout=900) for _ in procs)
    print(json.dumps({
        "bench": "tp_forward", "model": args.model, "tp_size": args.tp_size, "batch": args.batch,
        "collectives": not args.no_collectives,
        "allreduce_fusion": args.enable_flashinfer_allreduce_fusion, "replay_ms": round(times[0], 4),
        "replay_ms_by_rank": [round(times[r], 4) for r in sorted(times)],
        "device": torch.cuda.get_device_name(0),
    }), flush=True)  # fmt: skip
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    main()
