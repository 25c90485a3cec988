"""The small all-reduces of tensor-parallel decode through symmetric memory.

At batch 1 a decode step all-reduces a few KiB twice per layer; NCCL's ring costs tens of
microseconds for each, a large share of the step once the weights are split over GPUs. Here
every rank keeps one buffer that the other ranks map (torch's symmetric memory over CUDA IPC,
no NVLink multicast), copies its partial sum there, and one kernel reads every rank's buffer and
writes the total (`symm_mem.one_shot_all_reduce`): one launch, no ring, captured by CUDA graphs
like any kernel. Tensors larger than the buffer, other dtypes, and other reductions go to NCCL.

Every rank must make the same choice for every tensor, or the group deadlocks: the buffer is
made on all ranks or on none (`create` agrees over the group), and `fits` looks only at the
tensor's size and dtype, which are the same on every rank.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# The largest tensor sent this way: a decode batch of up to 64 rows of hidden size 4096 in bf16.
MAX_BYTES = 512 << 10


class SymmetricAllReduce:
    def __init__(self, buffer: torch.Tensor, group_name: str) -> None:
        self.buffer = buffer
        self.group_name = group_name
        # Newer torch copies the input into the buffer inside the kernel (one launch, not two).
        self._copy_in = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)

    @classmethod
    def create(
        cls, group: dist.ProcessGroup | None, device: torch.device, dtype: torch.dtype,
        max_bytes: int = MAX_BYTES,
    ) -> SymmetricAllReduce | None:  # fmt: skip
        """The fast path for `dtype` on this rank, or None on every rank of `group` (NCCL
        then) where it cannot run: not CUDA, a dtype the kernel lacks, or symmetric memory
        unavailable on any rank (logged)."""
        if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float32):
            return None
        made = None
        try:
            from torch.distributed import _symmetric_memory as symm_mem

            name = (group or dist.group.WORLD).group_name
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                with warnings.catch_warnings():  # a no-op, deprecated, in newer torch
                    warnings.simplefilter("ignore")
                    symm_mem.enable_symm_mem_for_group(name)
            buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, name)
            made = cls(buffer, name)
        except (ImportError, RuntimeError, AttributeError) as e:
            logger.warning("symmetric-memory all-reduce unavailable (%s); using NCCL", e)
        ok = torch.tensor([int(made is not None)], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if not ok.item():
            return None
        logger.info("tensor-parallel all-reduce of up to %d KiB through symmetric memory", max_bytes >> 10)
        return made

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.dtype == self.buffer.dtype
            and x.numel() <= self.buffer.numel()
            and x.is_contiguous()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the group into `x` (in place) and returns it."""
        flat, staged = x.view(-1), self.buffer[: x.numel()]
        if self._copy_in is not None:
            self._copy_in(staged, flat, "sum", self.group_name, flat)
        else:
            staged.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        return x
