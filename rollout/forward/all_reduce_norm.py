"""AllReduceNorm: the sum over the tensor-parallel group of a row-parallel projection's partial
outputs, fused with what follows it in every decoder layer: the residual add and the RMSNorm.

At tp > 1 each o_proj and down_proj ends in an all-reduce, and the norm after it adds the
residual and normalises: two launches, the first a collective whose cost at decode sizes is
its latency. With a model's all-reduces deferred to its norms (DecoderModel.defer_all_reduces)
the norm receives the unreduced partial sums and this does all three: in one FlashInfer kernel
(TensorRT-LLM's all-reduce fusion, peers' buffers written directly over NVLink) for batches of
up to `max_tokens` rows (FUSED_MAX_TOKENS unless given), else the group's all-reduce followed by
the norm's own kernel.
Without a workspace (a CPU, gloo, float32) it is always the latter: the same operations as
before the deferral, in the same order.

With a SymmetricSum (symm_mem_allreduce_min_rows), batches of its min_rows up to its buffer's
rows are summed there instead, in place where the projection wrote into the buffer (`out_for`),
then normed by the norm's own kernel. The rule, by the batch's rows: the symmetric sum where it
takes them, else the fused kernel up to `max_tokens`, else NCCL. So with both on, a min_rows at
or below max_tokens gives the fused kernel only the batches below it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rollout.forward.symmetric_sum import SymmetricSum
from rollout.forward.tensor_parallel import TPGroup

if TYPE_CHECKING:
    from rollout.forward.kernel_plan import KernelPlan
    from rollout.models.layers import RMSNorm

# Batches above this run the all-reduce and the norm apart: the fused kernel's workspace grows
# with the rows it takes, and large prefill batches gain little from saving a launch.
FUSED_MAX_TOKENS = 2048


class AllReduceNorm:
    def __init__(
        self,
        tp: TPGroup,
        workspace: object | None = None,
        pdl: bool = False,
        max_tokens: int = FUSED_MAX_TOKENS,
        symmetric: SymmetricSum | None = None,
    ) -> None:
        """workspace: FlashInfer's all-reduce fusion workspace for this rank (None: unfused),
        made for batches of up to `max_tokens` rows; pdl: launch the fused kernel with
        programmatic dependent launch (rollout_kernels.pdl), as the plan launches the Triton
        kernels around it; symmetric: the sum in symmetric memory for the batches it takes."""
        self.tp = tp
        self.workspace = workspace
        self.pdl = pdl
        self.max_tokens = max_tokens
        self.symmetric = symmetric

    @classmethod
    def for_plan(
        cls, plan: KernelPlan, tp: TPGroup, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> AllReduceNorm | None:
        """The sums `plan` defers to the norms (None: it defers none): every rank of `tp` must
        call this together, on its GPU, before any CUDA graph capture. RuntimeError, naming
        symm_mem_allreduce_min_rows, where the plan asks for symmetric memory that cannot run."""
        symmetric = None
        if plan.symm_mem_allreduce_min_rows:
            symmetric = SymmetricSum.allocate(
                tp, plan.symm_mem_allreduce_min_rows, plan.symm_mem_allreduce_max_rows, hidden,
                dtype, device,
            )  # fmt: skip
        if plan.allreduce_fusion:
            return cls.flashinfer(tp, hidden, dtype, plan.programmatic_launch, symmetric=symmetric)
        return None if symmetric is None else cls(tp, symmetric=symmetric)

    @classmethod
    def flashinfer(
        cls,
        tp: TPGroup,
        hidden: int,
        dtype: torch.dtype,
        pdl: bool = False,
        max_tokens: int = FUSED_MAX_TOKENS,
        symmetric: SymmetricSum | None = None,
    ) -> AllReduceNorm:
        """With FlashInfer's fused kernel for batches of up to `max_tokens` rows (its workspace
        grows with them): every rank of `tp` must call this together (the ranks exchange their
        buffers' IPC handles), on its GPU, before any CUDA graph capture."""
        from flashinfer.comm import create_allreduce_fusion_workspace

        workspace = create_allreduce_fusion_workspace(
            backend="trtllm", world_size=tp.size, rank=tp.rank, max_token_num=max_tokens,
            hidden_dim=hidden, dtype=dtype, group=tp.group,
        )  # fmt: skip
        return cls(tp, workspace, pdl, max_tokens, symmetric)

    @property
    def fused(self) -> bool:
        return self.workspace is not None

    def out_for(self, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where the projection before this should write its partial sums of `rows` rows (a
        view of the symmetric buffer), or None: anywhere (RowParallelLinear.out_for)."""
        return None if self.symmetric is None else self.symmetric.out_for(rows, dtype)

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this rank's partial sums [T, hidden]; residual: [T, hidden] -> (norm(sum + residual),
        sum + residual), as norm(x, residual) returns for a reduced x. Both are new tensors:
        neither aliases x, nor the symmetric buffer that the next projection writes into."""
        rows = x.shape[0]
        if self.symmetric is not None and self.symmetric.takes(rows, x.dtype):
            return norm.add_norm(self.symmetric.sum(x), residual)
        if self.workspace is None or not 0 < rows <= self.max_tokens:
            return norm.add_norm(self.tp.all_reduce(x), residual)
        from flashinfer.comm import AllReduceFusionPattern, allreduce_fusion

        out, summed = torch.empty_like(x), torch.empty_like(x)
        allreduce_fusion(
            input=x.contiguous(), workspace=self.workspace,
            pattern=AllReduceFusionPattern.kARResidualRMSNorm, launch_with_pdl=self.pdl,
            # With PDL the next kernel may be scheduled as soon as this one starts: every PDL
            # kernel waits for its predecessor's end before it reads (rollout_kernels.pdl).
            trigger_completion_at_end=not self.pdl,
            residual_out=summed, norm_out=out, residual_in=residual.contiguous(),
            rms_gamma=norm.weight, rms_eps=norm.eps, fp32_acc=True,
        )  # fmt: skip
        return out, summed
