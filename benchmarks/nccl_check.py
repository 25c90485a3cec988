"""The weight-sync transport alone: two processes join an UpdateGroup and broadcast, with no
engine around them. Each phase is printed as it passes (with seconds since start), so a hang
shows where it sits; a rank that does not finish within --timeout is reported and killed.

    NCCL_DEBUG=INFO python benchmarks/nccl_check.py                # NCCL, rank r on cuda:r
    python benchmarks/nccl_check.py --gpus 1 0 --trainer-current-device 0  # as the two-GPU test runs it
    python benchmarks/nccl_check.py --backend gloo                 # on the host, no GPU

Run it under NCCL settings to compare (e.g. NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1,
NCCL_CUMEM_ENABLE=0); keep NCCL_NVLS_ENABLE=0 on shared machines.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rollout.weight_sync.update_group import UpdateGroup  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, args: argparse.Namespace, start: float) -> None:
    def say(what: str) -> None:
        print(f"[rank {rank} {time.time() - start:7.2f} s] {what}", flush=True)

    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", args.gpus[rank])
        current = args.gpus[rank]
        if rank == 0 and args.trainer_current_device is not None:
            current = args.trainer_current_device
        torch.cuda.set_device(current)
        say(f"group device {device}, current device cuda:{current}")
    group = UpdateGroup.join("127.0.0.1", port, rank, 2, "nccl-check", args.backend, args.timeout, device)
    say("joined (one broadcast done)")
    n = args.mib << 18  # float32 elements
    for step in range(args.steps):
        data = torch.arange(n, dtype=torch.float32, device=device) + step if rank == 0 else torch.empty(n, device=device)
        began = time.perf_counter()
        group.broadcast(data, f"step {step}")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - began
        if rank == 1:
            want = torch.arange(n, dtype=torch.float32, device=device) + step
            assert torch.equal(data, want), f"step {step}: received data differs"
        say(f"step {step}: {args.mib} MiB in {seconds * 1e3:.1f} ms")
    group.close()
    say("closed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds for joining and for each broadcast")
    parser.add_argument("--mib", type=int, default=64, help="size of each broadcast")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gpus", type=int, nargs=2, default=[0, 1], help="the GPU of rank 0 (the trainer) and rank 1")
    parser.add_argument(
        "--trainer-current-device", type=int,
        help="rank 0's current CUDA device, when it should differ from its group device",
    )  # fmt: skip
    args = parser.parse_args()
    if args.backend == "nccl" and torch.cuda.device_count() < 2:
        parser.error(f"the nccl check needs two GPUs, found {torch.cuda.device_count()}")
    port, start = _free_port(), time.time()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, args, start), name=f"rank{r}") for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout * (args.steps + 2) + 30
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p.name for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    failed = [p.name for p in procs if p.exitcode not in (0, None) and p.name not in hung]
    print(f"hung: {hung or 'none'}; failed: {failed or 'none'}", flush=True)
    sys.exit(1 if hung or failed else 0)


if __name__ == "__main__":
    main()
