"""SymmetricSum: a row-parallel projection's partial outputs summed over the tensor-parallel group
in a buffer of symmetric memory, which every rank maps and reads from its peers over NVLink.

torch's two-shot all-reduce over such a buffer takes less time than NCCL's at a long prefill's
sizes, but copying the partial sums in first eats most of that (benchmarks/RESULTS.md,
bench_allreduce_norm.py --symm-mem). So the projection writes its GEMM's output straight
into the buffer's first rows (`out_for`, asked by RowParallelLinear through the AllReduceNorm
after it), and the sum runs in place there (`sum`). The two-shot kernel loads from peers; it
needs no NVLink multicast, which the engine leaves off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless
the environment says otherwise).

The norm after the sum writes new tensors (its output and the next residual), so nothing of a
layer outlives the buffer's next use by the layer after it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from rollout.forward.tensor_parallel import TPGroup

OPTION = "symm_mem_allreduce_min_rows"
MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"


class SymmetricSum:
    def __init__(
        self, buffer: torch.Tensor, sum_in_place: Callable[[torch.Tensor], object], min_rows: int
    ) -> None:
        """buffer: [max_rows, hidden], the same shape and dtype on every rank; sum_in_place(view)
        sums `view` (the buffer's first rows) over the group in place, every rank together:
        torch's two-shot all-reduce on GPUs (`allocate`), any all-reduce in tests."""
        self.buffer = buffer
        self.sum_in_place = sum_in_place
        self.min_rows = min_rows

    @classmethod
    def allocate(
        cls, tp: TPGroup, min_rows: int, max_rows: int, hidden: int, dtype: torch.dtype,
        device: torch.device,
    ) -> SymmetricSum:  # fmt: skip
        """A buffer of `max_rows` rows in symmetric memory, summed by torch's two-shot
        all-reduce: every rank of `tp` must call this together (the ranks exchange their
        buffers' handles, then sum one row as a check), on its GPU, before any CUDA graph
        capture. RuntimeError, naming the option, where symmetric memory cannot run.
        NVLink multicast stays off unless the environment turns it on: the two-shot sum needs
        none, and a multicast object can fail (or worse) on hosts that do not support it."""
        os.environ.setdefault(MULTICAST_ENV, "1")  # read at the first symmetric allocation
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buffer = symm_mem.empty((max_rows, hidden), dtype=dtype, device=device)
            group_name = (tp.group or dist.group.WORLD).group_name
            symm_mem.rendezvous(buffer, group_name)
            two_shot = torch.ops.symm_mem.two_shot_all_reduce_

            def sum_in_place(view: torch.Tensor) -> None:
                two_shot(view, "sum", group_name)

            sum_in_place(buffer[:1].zero_())
        except (ImportError, AttributeError, RuntimeError) as exc:
            raise RuntimeError(
                f"{OPTION} sums in torch's symmetric memory, which cannot run here "
                f"({type(exc).__name__}: {exc}); set {OPTION}=0 for NCCL's all-reduce"
            ) from exc
        return cls(buffer, sum_in_place, min_rows)

    @property
    def max_rows(self) -> int:
        return self.buffer.shape[0]

    def takes(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether partial sums of `rows` rows in `dtype` (the model's) are summed here."""
        return self.min_rows <= rows <= self.max_rows and dtype == self.buffer.dtype

    def out_for(self, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where a projection should write its partial sums of `rows` rows: the buffer's first
        rows when they are summed here, else None (it writes a tensor of its own)."""
        return self.buffer[:rows] if self.takes(rows, dtype) else None

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x: this rank's partial sums [T, hidden] (taken here) -> the group's sum, in the
        buffer's first T rows. x is copied there first unless it already is that view."""
        view = self.buffer[: x.shape[0]]
        if x.data_ptr() != view.data_ptr() or x.shape != view.shape:
            view.copy_(x)
        self.sum_in_place(view)
        return view
