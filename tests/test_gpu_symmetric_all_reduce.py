"""The symmetric-memory all-reduce of tensor-parallel decode, on two GPUs: its sums equal NCCL's
(exactly for two ranks: one addition per element), eagerly and replayed from a CUDA graph with
new inputs, and the tensors it does not take (too large, another dtype) go to NCCL."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, error_file: str) -> None:
    try:
        import torch.distributed as dist

        from rollout.forward.tensor_parallel import TPGroup

        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        gen = torch.Generator(device=device).manual_seed(rank)
        for dtype in (torch.bfloat16, torch.float32):
            tp = TPGroup.from_group().with_symmetric_all_reduce(device, dtype)
            fast = tp.small_all_reduce
            assert fast is not None, "symmetric memory was not set up"
            whole = (fast.buffer.numel() // 4096, 4096)  # fills the buffer
            for shape in ((1, 3584), (7, 4096), whole, (3, 5)):
                x = torch.randn(shape, generator=gen, device=device).to(dtype)
                want = x.clone()
                dist.all_reduce(want)
                assert fast.fits(x), shape
                assert torch.equal(tp.all_reduce(x), want), (dtype, shape)
            big = torch.randn(fast.buffer.numel() + 8, generator=gen, device=device).to(dtype)
            assert not fast.fits(big) and not fast.fits(big[:8].half())
            want = big.clone()
            dist.all_reduce(want)
            assert torch.equal(tp.all_reduce(big), want)  # NCCL took it

            # Captured: two all-reduces in a row, replayed with new inputs.
            static = torch.zeros(4, 1024, device=device, dtype=dtype)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                tp.all_reduce(static.clone())  # warm up outside the capture
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = tp.all_reduce(static * 2)
                out = tp.all_reduce(out + 1)
            for _ in range(3):
                static.copy_(torch.randn(static.shape, generator=gen, device=device))
                want = static * 2
                dist.all_reduce(want)
                want += 1
                dist.all_reduce(want)
                graph.replay()
                torch.cuda.synchronize(device)
                assert torch.equal(out, want), dtype
        dist.destroy_process_group()
    except BaseException:
        with open(error_file, "w") as f:
            f.write(f"rank {rank}: {traceback.format_exc()}")
        os._exit(1)


def test_symmetric_all_reduce_equals_nccl_eagerly_and_in_cuda_graphs(tmp_path):
    ctx, port = mp.get_context("spawn"), _free_port()
    files = [str(tmp_path / f"rank{r}.err") for r in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, port, files[r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        p.kill()
    failures = [open(f).read() for f in files if os.path.exists(f)]
    assert not alive, f"ranks still running after 120 s: {alive}"
    assert not failures, "\n".join(failures)
    assert [p.exitcode for p in procs] == [0, 0]
