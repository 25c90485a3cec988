"""The decode forward alone, at tensor parallelism N: prints one JSON line.

    python benchmarks/bench_tp_forward.py --model qwen2.5-7b --tp-size 1
    python benchmarks/bench_tp_forward.py --model qwen2.5-7b --tp-size 2
    python benchmarks/bench_tp_forward.py --model qwen2.5-7b --tp-size 2 --no-collectives
    python benchmarks/bench_tp_forward.py --model llama-3.1-8b --tp-size 2 --batch 256 \
        --context 3700 --kernels 20

Each rank (one process per GPU) builds the engine's own ModelRunner (the real config's shapes,
random bf16 weights) and replays its CUDA graph of a --batch decode step, with nothing around
it: no scheduler, no step messages between ranks, no sampling. The milliseconds per replay (CUDA
events on rank 0) are the device's share of a step; bench_latency.py's decode step less this is
the host's. --no-collectives replaces the all-reduce and all-gather with local stand-ins of the
same shapes (wrong numbers, right kernels otherwise): the collectives' share.

With --context L each of the --batch requests attends over L tokens of its own (distinct KV
slots, the pool sized to hold them all; with --decoded F the last F of them in the slots a
decode step allocates, one a request, interleaved over the batch): the large decode steps of a long workload, whose
attention the default (one token each) leaves out. --eager runs such a step as the engine runs
a batch past its largest graph (the attention backend's plan, then the model's forward, each
iteration). host_ms is the host's time to queue one step with the device idle (the graph's
replay, or the eager forward's launches). --kernels N prints rank 0's N kernels of most device
time over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rollout.real_configs import REAL_CONFIGS, write_config_checkpoint  # noqa: E402

WARMUP = 20
PROFILED = 10  # steps --kernels profiles
HOST_STEPS = 5  # steps host_ms is the median of


def free_port() -> int:
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
    context = max(args.context, 1)
    options = EngineOptions.from_kwargs(
        model_path=path, load_format="dummy", dtype="bfloat16", device=f"cuda:{rank}",
        tp_size=args.tp_size, max_total_tokens=max(16384, args.batch * context + 64),
        max_running_requests=args.batch, cuda_graph_max_bs=args.batch,
        disable_cuda_graph=args.eager, disable_pdl=args.disable_pdl,
        attention_backend=args.attention_backend,
        enable_flashinfer_allreduce_fusion=args.enable_flashinfer_allreduce_fusion,
    )  # fmt: skip
    config = AutoConfig.from_pretrained(path)
    runner = ModelRunner(options, config, config.max_position_embeddings, [], tp)
    step = _step(runner, args.batch, context, args.decoded) if args.context or args.eager else None
    if step is None:
        graphs = runner.graph_runner
        step = graphs.graphs[padded_size(graphs.sizes, args.batch)].replay
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        step()
    end.record()
    torch.cuda.synchronize()
    # The host's time to queue one step, the device idle before it (each step alone: the
    # launch queue never fills, so nothing here waits for the device).
    queued = []
    for _ in range(HOST_STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        queued.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    results.put((rank, start.elapsed_time(end) / args.iters, statistics.median(queued) * 1e3))
    # The queue's feeder thread sends the result; os._exit below would drop it unsent.
    results.close()
    results.join_thread()
    if args.kernels and rank == 0:
        _print_kernels(step, args.kernels)
    elif args.kernels:
        for _ in range(PROFILED):  # the collectives need every rank
            step()
        torch.cuda.synchronize()
    if args.tp_size > 1:
        dist.barrier()
    # Without destroy_process_group: with CUDA graphs that captured its collectives still
    # alive it blocked (and the engine's ranks never call it either); exiting frees it all.
    os._exit(0)


def _step(runner, batch: int, context: int, decoded: float = 0.0):
    """A decode step of `batch` requests over `context` tokens each, built and run as the
    engine builds and runs it (ModelRunner's own decode batch; from the graph of its size, or
    eagerly when there is none). Returns the step as a callable. The KV slots are laid out as
    the engine's allocator leaves them (slot 0 is the graphs' padding): the last `decoded`
    share of each request's tokens came one a step."""
    from rollout.engine.messages import TokenizedRequest
    from rollout.engine.req import Req, ScheduleBatch
    from rollout.engine.sampling_params import SamplingParams
    from rollout.forward.forward_batch import ForwardMode

    rows = torch.arange(batch, dtype=torch.int64)
    prompt = context - round(decoded * context)
    # The prompt's slots in one run a request (a prefill allocates them together), the decoded
    # tokens' interleaved over the batch (each decode step allocates one slot a request).
    slots = 1 + rows[:, None] * prompt + torch.arange(prompt)[None, :]
    steps = torch.arange(context - prompt)[None, :]
    slots = torch.cat([slots, 1 + batch * prompt + steps * batch + rows[:, None]], dim=1)
    runner.req_to_token.table[:batch, :context] = slots.to(runner.device)
    reqs = [
        Req(TokenizedRequest(str(i), [1], SamplingParams()), 1, row=i, kv_len=context - 1)
        for i in range(batch)
    ]
    schedule = ScheduleBatch(ForwardMode.DECODE, reqs, [1] * batch, slots[:, -1].contiguous())
    fb = runner._build_decode(schedule)[0]

    @torch.inference_mode()
    def step() -> torch.Tensor:
        return runner._run_model(fb)

    return step


def _print_kernels(step, count: int) -> None:
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(PROFILED):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="self_cuda_time_total", row_limit=count, max_name_column_width=70
    )
    print(f"--- rank 0, {PROFILED} steps\n{table}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", choices=sorted(REAL_CONFIGS))
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--context", type=int, default=0, help="KV tokens each request attends over")
    parser.add_argument("--decoded", type=float, default=0.0,
                        help="share of each context decoded one token a step (slots interleaved over the batch)")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs: the plan and forward each step")
    parser.add_argument("--disable-pdl", action="store_true", help="no programmatic dependent launch")
    parser.add_argument("--kernels", type=int, default=0, help="print rank 0's top N kernels")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--no-collectives", action="store_true")
    parser.add_argument("--enable-flashinfer-allreduce-fusion", action="store_true")
    args = parser.parse_args()
    if args.no_collectives and args.enable_flashinfer_allreduce_fusion:
        parser.error("--no-collectives replaces the unfused all-reduce only: the fused one would still run")
    if torch.cuda.device_count() < args.tp_size:
        parser.error(f"--tp-size {args.tp_size} needs as many GPUs, found {torch.cuda.device_count()}")
    path = write_config_checkpoint(args.model, tempfile.mkdtemp(prefix=f"rollout-{args.model}-"))
    ctx, port = mp.get_context("spawn"), free_port()
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, path, port, results)) for r in range(args.tp_size)]
    for p in procs:
        p.start()
    times, host = {}, {}
    for _ in procs:
        rank, ms, host_ms = results.get(timeout=900)
        times[rank], host[rank] = ms, host_ms
    print(json.dumps({
        "bench": "tp_forward", "model": args.model, "tp_size": args.tp_size, "batch": args.batch,
        "context": args.context, "decoded": args.decoded, "eager": args.eager,
        "pdl": not args.disable_pdl, "collectives": not args.no_collectives,
        "allreduce_fusion": args.enable_flashinfer_allreduce_fusion, "replay_ms": round(times[0], 4),
        "replay_ms_by_rank": [round(times[r], 4) for r in sorted(times)],
        "host_ms_by_rank": [round(host[r], 3) for r in sorted(host)],
        "device": torch.cuda.get_device_name(0),
    }), flush=True)  # fmt: skip
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    main()
