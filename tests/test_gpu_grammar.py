"""Grammars and logit_bias on the GPU's sampling path: the grammar mask and the biases go into
logits that the sampling kernel then draws from (from 32 rows on with top-p, every batch
without filters), between CUDA-graph decode steps. Constrained outputs always match, and a
bias forces or bans its token."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from rollout import RolloutEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 30},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "days", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def engine(tiny_qwen2, request):
    with RolloutEngine(tiny_qwen2, dtype=request.param, device="cuda", max_total_tokens=20000) as eng:
        yield eng


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.95}], ids=["no-filter", "top-p"])
def test_json_schema_outputs_always_validate(engine, filters):
    params = {"temperature": 1.0, "max_new_tokens": 128, "n": 64, "seed": 7, "json_schema": SCHEMA, **filters}
    outs = engine.generate(prompt="Plan a trip:", sampling_params=params)
    assert len(outs) == 64
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert len({out["text"] for out in outs}) > 5  # sampled, not one forced string


def test_logit_bias_forces_and_bans_beside_constrained_rows(engine):
    forced = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "logit_bias": {"7": 100.0}}
    banned = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 6, "ignore_eos": True,
              "logit_bias": {"7": -100.0}}  # fmt: skip
    constrained = {"temperature": 1.0, "max_new_tokens": 128, "seed": 3, "json_schema": SCHEMA}
    outs = engine.generate(
        prompt=["Hello there"] * 48,
        sampling_params=[forced] * 16 + [banned] * 16 + [constrained] * 16,
    )
    for out in outs[:16]:
        assert out["output_ids"] == [7] * 6
    for out in outs[16:32]:
        assert len(out["output_ids"]) == 6 and 7 not in out["output_ids"]
    for out in outs[32:]:
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
