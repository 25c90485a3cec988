"""Building blocks shared by the model files: norms, rotary embedding, fused projections.

Each block has a torch path (the reference, any device) and, once `use_fused_kernels` has
switched a model over, a path through the Triton kernels of `rollout_kernels` that does the
same arithmetic in one launch instead of one kernel per elementwise op. A decode step of a
small model is mostly those launches (benchmarks/RESULTS.md counts them for Qwen3-0.6B). Whether
and where the kernels run is the KernelPlan's decision (rollout.forward.kernel_plan).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from rollout.forward.all_reduce_norm import AllReduceNorm
from rollout.forward.kernel_plan import SKINNY_MIN_WEIGHT
from rollout.forward.tensor_parallel import SINGLE, TPGroup, make_shard

if TYPE_CHECKING:
    from rollout.models.lora_layer import LoraLayer

# Rope types whose frequencies are fixed at init. "dynamic" is exact up to the original
# context length; beyond it HF rescales by the batch's longest sequence, which depends on
# what else is batched, so an engine keeps the base frequencies there.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@functools.cache
def kernel(name: str) -> ModuleType:
    """rollout_kernels.<name>, imported on first use (Triton is needed only on this path)."""
    return importlib.import_module(f"rollout_kernels.{name}")


class FusedOps:
    """Mixin of the blocks that have a fused-kernel path; off until `use_fused_kernels`."""

    fused = False
    skinny_rows = 0  # linear layers of at most this many rows run the skinny GEMM kernel
    batch_invariant = False  # linear layers and the LM head run the batch-invariant GEMM


def use_fused_kernels(
    model: nn.Module,
    enabled: bool = True,
    skinny_rows: int = 0,
    skinny_min_weight: int = SKINNY_MIN_WEIGHT,
    batch_invariant: bool = False,
) -> None:
    """Switches every block of `model` to (or back from) the Triton kernels. Outputs agree
    with the torch path to rounding; both paths round where HF's modules round. With
    `skinny_rows`, linear layers over at most that many tokens (a small decode batch) use
    rollout_kernels.skinny_gemm instead of torch's GEMM: those whose weight has at least
    `skinny_min_weight` elements, and the LM head. With `batch_invariant` (deterministic
    inference), every linear layer and the LM head run rollout_kernels.batch_invariant_gemm."""
    for module in model.modules():
        if isinstance(module, FusedOps):
            small = isinstance(module, nn.Linear) and module.weight.numel() < skinny_min_weight
            module.fused = enabled
            module.skinny_rows = skinny_rows if enabled and not small else 0
            module.batch_invariant = enabled and batch_invariant


# The skinny GEMM's tiles: the best for three of Qwen2.5-7B's five projections at one row in
# benchmarks/bench_gemv.py's search, in a run whose weights were partly L2-resident; with the
# weights cycled past L2 since, they stay close to the best tiles searched on the projections
# the kernel takes (benchmarks/RESULTS.md, seventh session).
SKINNY_GEMM_TILES = {"block_n": 32, "block_k": 512, "num_warps": 4, "num_stages": 5}


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, skinny_rows: int = 0,
    invariant: bool = False, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x: [T, in] -> [T, out], through the skinny GEMM kernel when 0 < T <= skinny_rows, through
    the batch-invariant one with `invariant`. Torch's GEMM writes into `out` ([T, out],
    contiguous) when given; the two kernels return tensors of their own."""
    if invariant:
        return kernel("batch_invariant_gemm").batch_invariant_linear(x, weight, bias)
    if 0 < x.shape[0] <= skinny_rows:
        return kernel("skinny_gemm").skinny_gemm(x, weight, bias, **SKINNY_GEMM_TILES)
    if out is not None:  # the GEMM F.linear runs on a 2-d x, into `out`
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)
    return F.linear(x, weight, bias)


def logits_linear(
    x: torch.Tensor, weight: torch.Tensor, skinny_rows: int = 0, invariant: bool = False
) -> torch.Tensor:
    """The LM head: x [T, hidden] -> float32 logits [T, vocab]. On CUDA a 16-bit GEMM writes
    float32 directly (torch.mm's out_dtype): no rounding of the logits to 16 bits, and no
    second pass over [T, vocab] to widen them, which costs most at many rows of a large
    vocabulary (benchmarks/RESULTS.md, sixth session)."""
    if invariant:
        gemm = kernel("batch_invariant_gemm")
        return gemm.batch_invariant_linear(x, weight, out_dtype=torch.float32)
    skinny = 0 < x.shape[0] <= skinny_rows
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and not skinny:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return linear(x, weight, None, skinny_rows).float()


class Linear(FusedOps, nn.Linear):
    """nn.Linear that runs the skinny GEMM kernel for small decode batches when switched on.
    `lora`, when an engine serves adapters, is the layer's adapter slots (models/lora.py):
    each row's adapter delta is added to the output."""

    lora: LoraLayer | None = None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] -> [T, out]; written into `out` where the GEMM can (see `linear`). An
        adapter's delta is added in place to the base output, in `out` too."""
        if self.lora is None:
            return self.base(x, out)
        return self.lora.around(x, functools.partial(self.base, x, out))

    def base(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The projection without any adapter delta."""
        return linear(x, self.weight, self.own_bias(), self.skinny_rows, self.batch_invariant, out)

    def own_bias(self) -> torch.Tensor | None:
        """The bias this layer adds (a row-parallel layer's rank 0 alone adds it)."""
        return self.bias


class RMSNorm(FusedOps, nn.Module):
    """`all_reduce`, when set (DecoderModel.defer_all_reduces), makes this the norm after a
    row-parallel projection that no longer sums its output: x is then this rank's partial sum,
    summed over the group here, with the residual add (forward/all_reduce_norm.py).
    `lora_delta`, when set (AdapterSlots), is the LoRA layer of the projection that writes x:
    the delta it leaves (LoraLayer.take_delta) is added to x here."""

    all_reduce: AllReduceNorm | None = None
    lora_delta: LoraLayer | None = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., D]. Without a residual returns norm(x); with one, (norm(x + residual),
        x + residual): the sum is the next layer's residual, so it is made only once."""
        if self.all_reduce is not None:
            assert residual is not None, "a deferred all-reduce is summed with the residual"
            return self.all_reduce(x, residual, self)
        delta = None if self.lora_delta is None else self.lora_delta.take_delta()
        return self.add_norm(x, residual, delta)

    def add_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        delta: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """forward's norm of x (reduced), with the residual added first when given, and a
        float32 `delta` added to x before that (rounded to x's dtype)."""
        if self.fused:
            return kernel("rmsnorm").rms_norm(x, self.weight, self.eps, residual, delta)
        if delta is not None:
            x = (x.float() + delta).to(x.dtype)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast before scaling, as HF does: bf16 results then match it bit for bit.
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


def rope_parameters(config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) across transformers versions: v5 folds both into
    `rope_parameters`, v4 keeps `rope_theta` and `rope_scaling` apart."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return float(theta), params


class RotaryEmbedding(nn.Module):
    """cos/sin of every token's position, computed once per forward and shared by all layers."""

    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        theta, params = rope_parameters(config)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type must be one of {', '.join(SUPPORTED_ROPE_TYPES)}, got {rope_type!r}"
            )
        # Where the model is being built (the torch.device context); the frequencies are
        # computed on CPU in any case, so building on "meta" works too.
        device = torch.empty(0).device
        with torch.device("cpu"):
            if rope_type == "default":
                exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
                inv_freq, self.scaling = 1.0 / (theta**exponents), 1.0
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        self.inv_freq = nn.Buffer(inv_freq.float().to(device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, sin), each [T, 1, D/2] float32, broadcasting over heads."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos = freqs.cos() * self.scaling
        sin = freqs.sin() * self.scaling
        return cos[:, None, :], sin[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] rotated in halves (the HF / GPT-NeoX layout); cos, sin: [T, 1, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class MergedLinear(Linear):
    """One Linear standing for several checkpoint projections stacked along the output dim,
    column-parallel under tensor parallelism.

    `parts` maps each checkpoint projection (e.g. "q_proj") to its number of output rows in
    the checkpoint, in order; `shards` (tensor parallel; default all rows) to the rows
    [start, stop) of it that this rank holds. Weight loading copies each checkpoint tensor's
    rows (or this rank's slice of them) into its rows of the fused weight.
    """

    def __init__(
        self,
        in_features: int,
        parts: dict[str, int],
        bias: bool,
        shards: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        shards = {name: (0, rows) for name, rows in parts.items()} | dict(shards or {})
        local = {name: stop - start for name, (start, stop) in shards.items()}
        super().__init__(in_features, sum(local.values()), bias=bias)
        self.parts = local  # rows of each projection in this rank's fused weight
        self.part_shards = {
            name: make_shard(0, *shards[name], rows) for name, rows in parts.items()
        }

    def part_rows(self) -> dict[str, tuple[int, int]]:
        """Checkpoint projection -> (first row, number of rows) in the fused weight."""
        rows, start = {}, 0
        for name, size in self.parts.items():
            rows[name] = (start, size)
            start += size
        return rows


class RowParallelLinear(Linear):
    """A Linear whose input features are split over the tensor-parallel group: each rank
    multiplies its slice and the partial outputs are summed (all-reduce). The bias is whole on
    every rank and added once, by rank 0 before the sum. At size 1 it is a plain Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        start, stop = tp.even_range(
            in_features,
            f"the input features of a {in_features}x{out_features} row-parallel projection",
        )
        super().__init__(stop - start, out_features, bias=bias)
        self.tp = tp
        self.hf_shards = {"weight": make_shard(1, start, stop, in_features)}

    # False (DecoderModel.defer_all_reduces): the output is this rank's partial sum, which
    # the norm after the layer sums over the group.
    reduce = True
    # With reduce False: out_for(rows, dtype) gives the buffer the norm after the layer sums
    # `rows` rows in (AllReduceNorm.out_for), where the output is then written; None: anywhere.
    out_for: Callable[[int, torch.dtype], torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / size] -> [T, out], the same on every rank. With adapters, this rank's
        # partial delta is added to its partial sums before they are summed.
        out = None if self.out_for is None else self.out_for(x.shape[0], x.dtype)
        y = super().forward(x, out)
        return self.tp.all_reduce(y) if self.tp.size > 1 and self.reduce else y

    def own_bias(self) -> torch.Tensor | None:
        return self.bias if self.tp.rank == 0 else None


class SiluAndMulMLP(FusedOps, nn.Module):
    """gate/up, SiLU-and-mul, down. `lora_delta`, when set (AdapterSlots), is gate/up's LoRA
    layer: the delta it leaves (LoraLayer.take_delta) is added as SiLU-and-mul reads the output."""

    lora_delta: LoraLayer | None = None

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        start, stop = tp.even_range(intermediate, "intermediate_size")
        self.intermediate = stop - start  # this rank's share
        self.gate_up_proj = MergedLinear(
            hidden,
            {"gate_proj": intermediate, "up_proj": intermediate},
            bias,
            {"gate_proj": (start, stop), "up_proj": (start, stop)},
        )
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)
        delta = None if self.lora_delta is None else self.lora_delta.take_delta()
        if self.fused:
            return self.down_proj(kernel("silu_and_mul").silu_and_mul(gate_up, delta))
        if delta is not None:
            gate_up = (gate_up.float() + delta).to(gate_up.dtype)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
