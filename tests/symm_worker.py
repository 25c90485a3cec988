"""One tensor-parallel rank of tests/test_symmetric_sum.py's spawned cases (run through
tp_worker.run_rank): the same shard of a tiny model run with its projections summing their own
outputs over gloo, then with the sums deferred to an AllReduceNorm whose SymmetricSum is an
ordinary tensor summed by gloo's all_reduce, as torch's two-shot all-reduce sums the symmetric
buffer on GPUs. Records how far the logits moved, which forwards the buffer summed, and which
projection outputs were written straight into it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from tp_worker import prefill_and_decode
from transformers import AutoConfig

from rollout.forward.all_reduce_norm import AllReduceNorm
from rollout.forward.forward_batch import ForwardBatch
from rollout.forward.symmetric_sum import SymmetricSum
from rollout.forward.tensor_parallel import TPGroup
from rollout.models.layers import RowParallelLinear
from rollout.models.loader import load_model
from rollout.models.lora import AdapterSlots


def run_symmetric_case(case: dict[str, Any], tp: TPGroup) -> dict[str, Any]:
    """case: path (a checkpoint; `overrides` of its config, `load_format`), min_rows and
    buffer_rows of the SymmetricSum; `copy`: the projections are not given the buffer (the
    AllReduceNorm copies their outputs in); `adapters`: each request's adapter (None: base),
    with `lora_path` loaded as "a"."""
    config = AutoConfig.from_pretrained(case["path"])
    for key, value in case.get("overrides", {}).items():
        setattr(config, key, value)
    fmt = case.get("load_format", "auto")
    model = load_model(case["path"], config, torch.float32, "cpu", fmt, tp=tp)
    vocab, prepare = config.vocab_size, None
    if "adapters" in case:
        slots = AdapterSlots(model, 1, 8)
        slots.load_path("a", case["lora_path"])
        prepare = _rows_on(slots, case["adapters"])
    want = prefill_and_decode(model, vocab, prepare=prepare)
    result: dict[str, Any] = {"scale": want.abs().max().item()}
    if prepare is not None:  # how much the adapter moves the logits: its delta must count
        base = prefill_and_decode(
            model, vocab, prepare=_rows_on(slots, [None] * len(case["adapters"]))
        )
        result["lora_effect"] = (want - base).abs().max().item()

    # NaN where no projection wrote: a sum that read rows it was not given would show.
    buffer = torch.full((case["buffer_rows"], config.hidden_size), float("nan"))
    summed: list[int] = []  # rows of each sum of the buffer

    def sum_in_place(view: torch.Tensor) -> None:
        summed.append(view.shape[0])
        dist.all_reduce(view, group=tp.group)

    model.model.defer_all_reduces(
        AllReduceNorm(tp, symmetric=SymmetricSum(buffer, sum_in_place, case["min_rows"]))
    )
    projections = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    if case.get("copy"):
        for projection in projections:
            projection.out_for = None
    written: list[tuple[int, bool]] = []  # (rows, written into the buffer) of each output
    for projection in projections:
        projection.register_forward_hook(
            lambda _m, _x, out: written.append((out.shape[0], out.data_ptr() == buffer.data_ptr()))
        )
    got = prefill_and_decode(model, vocab, prepare=prepare)
    result.update(
        err=(got - want).abs().max().item(),
        summed=summed,
        written=written,
        projections=len(projections),
    )
    return result


def _rows_on(slots: AdapterSlots, names: list[str | None]) -> Callable[[ForwardBatch], None]:
    """The `prepare` of each forward: request i's rows on adapter names[i] (None: base)."""
    return lambda fb: slots.prepare_batch(names, fb.extend_lens_cpu)
