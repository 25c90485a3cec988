"""The sum in symmetric memory (symm_mem_allreduce_min_rows) on the host: there is no symmetric
memory without a GPU, so the buffer is an ordinary tensor and gloo's all_reduce sums it, as
torch's two-shot all-reduce does on GPUs (tests/symm_worker.py). Two spawned ranks give the same
logits with the sums in the buffer as with each projection summing its own output, through a
prefill the buffer takes and decodes below min_rows; the projections write straight into the
buffer (no copy) when the rows are in range, their outputs are copied in when they did not,
and a prefill past the buffer is summed as before; with LoRA on o_proj and down_proj too. In
one process: which rows take which sum, and that the norm's outputs never alias the buffer.
(On two GPUs: tests/test_gpu_tensor_parallel.py.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import types

import pytest
import torch
from symm_worker import run_symmetric_case
from test_tensor_parallel_model import spawn_ranks
from tp_worker import DECODE_STEPS, PROMPT_LENS

from rollout.config import EngineOptions
from rollout.forward.all_reduce_norm import AllReduceNorm
from rollout.forward.kernel_plan import resolve_kernel_plan
from rollout.forward.symmetric_sum import SymmetricSum
from rollout.forward.tensor_parallel import SINGLE, TPGroup
from rollout.models.layers import RMSNorm, linear

TOL = 1e-5
PREFILL = sum(PROMPT_LENS)  # rows of the spawned cases' prefill
DECODE = len(PROMPT_LENS)  # ... and of each of their DECODE_STEPS decodes
IN_RANGE = {"min_rows": 8, "buffer_rows": 64}  # takes the prefill, not the decodes


@pytest.fixture(scope="module")
def two_ranks(tiny_qwen3, tiny_llama, tmp_path_factory) -> list[dict]:
    cases = {
        "in range": {"path": tiny_qwen3, **IN_RANGE},
        # Row-parallel biases: rank 0's projections add theirs in the GEMM into the buffer.
        "biases": {
            "path": tiny_llama,
            "overrides": {"attention_bias": True, "mlp_bias": True},
            "load_format": "dummy",
            **IN_RANGE,
        },
        "past the buffer": {"path": tiny_qwen3, "min_rows": 8, "buffer_rows": PREFILL - 1},
        "copied": {"path": tiny_qwen3, "copy": True, **IN_RANGE},
    }
    if _has_peft():
        from lora_helpers import make_peft_adapter

        root = tmp_path_factory.mktemp("symm-lora")
        adapter = make_peft_adapter(tiny_qwen3, str(root / "a"), 4, 8, "all-linear", seed=3)
        cases["lora"] = {"path": tiny_qwen3, "lora_path": adapter,
                         "adapters": [None, "a", "a"], **IN_RANGE}  # fmt: skip
    return spawn_ranks(2, cases, tmp_path_factory.mktemp("symm"), run=run_symmetric_case)


def _has_peft() -> bool:
    return importlib.util.find_spec("peft") is not None


def _same_logits(results: list[dict], case: str) -> list[dict]:
    """Each rank's result of `case`, once its logits are checked against the plain path's."""
    got = [by_case[case] for by_case in results]
    for rank, result in enumerate(got):
        assert result["scale"] > 0.01, f"{case}: logits too small to compare"
        assert result["err"] <= TOL, f"{case}, rank {rank}: max |logit diff| {result['err']:.3g}"
    return got


def _written(projections: int, in_buffer: bool) -> list[list]:
    """Each projection's (rows, written into the buffer) through the prefill and the decodes."""
    prefill = [[PREFILL, in_buffer]] * projections
    return prefill + [[DECODE, False]] * projections * DECODE_STEPS


@pytest.mark.parametrize("case", ["in range", "biases"])
def test_projections_write_a_prefill_into_the_buffer_summed_in_place(two_ranks, case):
    for result in _same_logits(two_ranks, case):
        n = result["projections"]  # o_proj and down_proj of every layer
        assert n == 4
        assert result["summed"] == [PREFILL] * n  # the decodes are below min_rows
        assert result["written"] == _written(n, in_buffer=True)


def test_outputs_the_projections_did_not_write_in_the_buffer_are_copied_in(two_ranks):
    for result in _same_logits(two_ranks, "copied"):
        n = result["projections"]
        assert result["summed"] == [PREFILL] * n
        assert result["written"] == _written(n, in_buffer=False)


def test_a_prefill_past_the_buffer_is_summed_as_without_it(two_ranks):
    for result in _same_logits(two_ranks, "past the buffer"):
        assert result["summed"] == []
        assert result["written"] == _written(result["projections"], in_buffer=False)


def test_lora_deltas_of_o_proj_and_down_proj_land_in_the_buffer(two_ranks):
    if not _has_peft():
        pytest.skip("needs peft")
    for result in _same_logits(two_ranks, "lora"):
        assert result["lora_effect"] > 1e-3  # the adapter's deltas move the logits
        n = result["projections"]
        assert result["summed"] == [PREFILL] * n
        assert result["written"] == _written(n, in_buffer=True)


# ---- in process --------------------------------------------------------------------------------

HIDDEN = 16


class _Paths:
    """Which sum each AllReduceNorm call took: the symmetric one, FlashInfer's fused kernel (a
    stand-in module) or the group's all-reduce."""

    def __init__(self, monkeypatch) -> None:
        self.taken: list[tuple[str, int]] = []
        comm = types.ModuleType("flashinfer.comm")
        comm.AllReduceFusionPattern = types.SimpleNamespace(kARResidualRMSNorm=0)
        comm.allreduce_fusion = self._fused
        monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
        monkeypatch.setitem(sys.modules, "flashinfer.comm", comm)
        monkeypatch.setattr(TPGroup, "all_reduce", lambda _tp, x: self._nccl(x))

    def _fused(self, input, residual_out, norm_out, residual_in, **_) -> None:
        self.taken.append(("fused", input.shape[0]))
        residual_out.copy_(input + residual_in)
        norm_out.copy_(residual_out)

    def _nccl(self, x: torch.Tensor) -> torch.Tensor:
        self.taken.append(("nccl", x.shape[0]))
        return x

    def symmetric(self, min_rows: int, max_rows: int) -> SymmetricSum:
        buffer = torch.zeros(max_rows, HIDDEN)
        return SymmetricSum(
            buffer, lambda view: self.taken.append(("symm", view.shape[0])), min_rows
        )


def test_the_symmetric_sum_takes_its_rows_first_then_the_fused_kernel_then_nccl(monkeypatch):
    paths = _Paths(monkeypatch)
    norm = RMSNorm(HIDDEN, 1e-6)
    both = AllReduceNorm(
        SINGLE, workspace=object(), max_tokens=200, symmetric=paths.symmetric(100, 300)
    )
    for rows in (1, 99, 100, 250, 300, 301):
        both(torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN), norm)
    assert paths.taken == [
        ("fused", 1), ("fused", 99), ("symm", 100), ("symm", 250), ("symm", 300), ("nccl", 301)
    ]  # fmt: skip
    paths.taken.clear()
    alone = AllReduceNorm(SINGLE, symmetric=paths.symmetric(100, 300))
    for rows in (99, 100, 301):
        alone(torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN), norm)
    half = torch.randn(100, HIDDEN, dtype=torch.bfloat16)  # not the buffer's dtype
    alone(half, half.clone(), norm)
    assert paths.taken == [("nccl", 99), ("symm", 100), ("nccl", 301), ("nccl", 100)]
    # Only the rows it sums are written in the buffer, and only in its dtype.
    assert alone.out_for(99, torch.float32) is None and alone.out_for(301, torch.float32) is None
    assert alone.out_for(100, torch.bfloat16) is None
    view = alone.out_for(100, torch.float32)
    assert view.data_ptr() == alone.symmetric.buffer.data_ptr() and view.shape == (100, HIDDEN)
    assert AllReduceNorm(SINGLE).out_for(100, torch.float32) is None


@pytest.mark.parametrize("fused", [False, True], ids=["torch norm", "norm kernel"])
def test_the_norm_after_the_sum_leaves_the_buffer_free_for_the_next_projection(fused):
    if fused:
        pytest.importorskip("triton")
    norm = RMSNorm(HIDDEN, 1e-6)
    norm.fused = fused
    symmetric = SymmetricSum(torch.zeros(8, HIDDEN), lambda view: view.mul_(2), 1)
    all_reduce = AllReduceNorm(SINGLE, symmetric=symmetric)
    x, residual = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    want = RMSNorm(HIDDEN, 1e-6).add_norm(2 * x, residual)
    out = all_reduce.out_for(5, x.dtype).copy_(x)  # as the projection's GEMM writes it
    got = all_reduce(out, residual, norm)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    buffer = symmetric.buffer.untyped_storage().data_ptr()
    assert all(g.untyped_storage().data_ptr() != buffer for g in got)
    symmetric.buffer.fill_(float("nan"))  # the next projection's output
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_linear_writes_torch_gemm_into_the_given_output():
    x, w, b = torch.randn(6, 8), torch.randn(4, 8), torch.randn(4)
    for bias in (None, b):
        out = torch.full((6, 4), float("nan"))
        got = linear(x, w, bias, out=out)
        assert got.data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias))


def test_where_symmetric_memory_cannot_run_the_error_names_the_option(monkeypatch):
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    with pytest.raises(RuntimeError, match=r"symm_mem_allreduce_min_rows sums in torch's symm"):
        SymmetricSum.allocate(TPGroup(0, 2), 8, 64, HIDDEN, torch.float32, torch.device("cpu"))
    # Multicast is left off before torch's first symmetric allocation, unless the user set it.
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    with pytest.raises(RuntimeError):
        SymmetricSum.allocate(TPGroup(0, 2), 8, 64, HIDDEN, torch.float32, torch.device("cpu"))
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "0"
    plan = resolve_kernel_plan(
        EngineOptions.from_kwargs(model_path="m"), torch.device("cpu"), torch.float32
    )
    assert AllReduceNorm.for_plan(plan, SINGLE, HIDDEN, torch.float32, torch.device("cpu")) is None
    symm = dataclasses.replace(plan, symm_mem_allreduce_min_rows=8, symm_mem_allreduce_max_rows=64)
    with pytest.raises(RuntimeError, match="set symm_mem_allreduce_min_rows=0"):
        AllReduceNorm.for_plan(symm, TPGroup(0, 2), HIDDEN, torch.float32, torch.device("cpu"))
