"""LoRA adapters served by the engine (CPU, float32, tiny Qwen3) against PEFT: a batch mixing the
base model and two adapters gives each PEFT's greedy tokens and logprobs; KV made under one
adapter (or an earlier load of it) is never reused by another; load/unload/reload; refusals
(unknown adapter, bad adapter, unloading one in use, an engine without LoRA) change nothing."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
from hf_reference import greedy_of
from lora_helpers import make_peft_adapter, peft_model

from rollout import RolloutEngine
from rollout.errors import InvalidRequest

pytest.importorskip("peft")

NEW = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37], [40, 41, 42, 43, 44, 45], [7, 7, 8, 8, 9, 9, 10]]
# name: (r, lora_alpha, target_modules)
ADAPTERS = {"a": (4, 8, "all-linear"), "b": (8, 16, ["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="module")
def adapters(tiny_qwen3, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("engine-lora")
    return {
        name: make_peft_adapter(tiny_qwen3, str(root / name), r, alpha, targets, seed=10 + i)
        for i, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def expected(tiny_qwen3, adapters) -> dict[str | None, list[list[int]]]:
    """PEFT's greedy tokens for every prompt, per adapter (None: the base model)."""
    return {
        name: greedy_of(peft_model(tiny_qwen3, None if name is None else adapters[name]), PROMPTS, NEW)
        for name in [None, *ADAPTERS]
    }


@pytest.fixture(scope="module")
def engine(tiny_qwen3, adapters):
    with RolloutEngine(
        tiny_qwen3, dtype="float32", device="cpu", max_total_tokens=4096,
        lora_paths=[f"a={adapters['a']}"], max_lora_rank=8, max_loras_per_batch=3,
    ) as eng:  # fmt: skip
        eng.load_lora_adapter("b", adapters["b"])
        yield eng


def _run(engine, lora, prompts=PROMPTS, **kw):
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=lora, **kw)
    return [o["output_ids"] for o in outs], outs


def test_a_mixed_batch_gives_each_adapter_pefts_tokens_and_logprobs(engine, expected, tiny_qwen3, adapters):
    names = [None, "a", "b"] * len(PROMPTS)
    prompts = [p for p in PROMPTS for _ in range(3)]
    ids, outs = _run(engine, names, prompts, return_logprob=True)
    for k, (prompt, name) in enumerate(zip(prompts, names)):
        assert ids[k] == expected[name][PROMPTS.index(prompt)], (k, name)
    # Logprobs of the sampled tokens against PEFT's forward over prompt + output.
    for name in ("a", "b"):
        model = peft_model(tiny_qwen3, adapters[name])
        k = names.index(name)
        full = torch.tensor([prompts[k] + ids[k]])
        with torch.no_grad():
            logp = torch.log_softmax(model(full).logits[0].float(), -1)
        want = [logp[len(prompts[k]) - 1 + i, t].item() for i, t in enumerate(ids[k])]
        got = [lp for lp, _, _ in outs[k]["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)


def test_kv_made_under_one_adapter_is_never_reused_by_another(engine, expected):
    prompt = [list(range(60, 100))]
    engine.generate(input_ids=prompt, sampling_params=GREEDY)  # cached under the base model
    _, (on_a,) = _run(engine, "a", prompt)
    assert on_a["meta_info"]["cached_tokens"] == 0
    _, (again,) = _run(engine, "a", prompt)
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == on_a["output_ids"]
    _, (on_b,) = _run(engine, "b", prompt)
    assert on_b["meta_info"]["cached_tokens"] == 0


def test_unload_and_reload_serve_the_same_adapter_with_fresh_kv(engine, expected, adapters):
    prompt = [PROMPTS[0]]
    _run(engine, "b", prompt)
    engine.unload_lora_adapter("b")
    assert "b" not in engine.get_server_info()["lora_adapters"]
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'b'"):
        _run(engine, "b", prompt)
    engine.load_lora_adapter("b", adapters["b"])
    ids, (out,) = _run(engine, "b", prompt)
    assert ids == [expected["b"][0]]
    assert out["meta_info"]["cached_tokens"] == 0  # a new load: the old KV is not its own
    assert engine.get_server_info()["lora_adapters"]["b"] == adapters["b"]


def test_bad_adapters_are_refused_and_change_nothing(engine, expected, tiny_qwen3, tmp_path):
    before = engine.get_server_info()["lora_adapters"]
    big = make_peft_adapter(tiny_qwen3, str(tmp_path / "big"), 16, 16, ["q_proj"], seed=3)
    with pytest.raises(InvalidRequest, match="rank 16 is above max_lora_rank 8"):
        engine.load_lora_adapter("big", big)
    broken = tmp_path / "broken"
    os.makedirs(broken)
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    with pytest.raises(InvalidRequest, match="adapter_model.safetensors"):
        engine.load_lora_adapter("broken", str(broken))
    with pytest.raises(InvalidRequest, match="loaded already"):
        engine.load_lora_adapter("a", big)
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'zzz'"):
        engine.unload_lora_adapter("zzz")
    assert engine.get_server_info()["lora_adapters"] == before
    assert _run(engine, "a", PROMPTS[:1])[0] == expected["a"][:1]


def test_all_slots_taken_is_a_clear_error(engine, adapters):
    engine.load_lora_adapter("c", adapters["a"])  # the third and last slot
    try:
        with pytest.raises(InvalidRequest, match="all 3 LoRA slots"):
            engine.load_lora_adapter("d", adapters["a"])
    finally:
        engine.unload_lora_adapter("c")


def test_an_adapter_in_use_cannot_be_unloaded(engine, expected):
    async def scenario():
        params = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
        stream = await engine.async_generate(
            input_ids=PROMPTS[1], sampling_params=params, lora_path="a", stream=True
        )
        first = await stream.__anext__()
        with pytest.raises(InvalidRequest, match="used by 1 queued or running"):
            engine.unload_lora_adapter("a")
        outs = [first]
        async for out in stream:
            outs.append(out)
        return outs[-1]

    last = asyncio.run(scenario())
    assert last["output_ids"][:NEW] == expected["a"][1]  # the request was not disturbed
    assert "a" in engine.get_server_info()["lora_adapters"]


def test_a_request_on_an_adapter_of_an_engine_without_lora_is_refused(tiny_qwen3):
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cpu", max_total_tokens=1024) as eng:
        with pytest.raises(InvalidRequest, match="serves no LoRA adapters"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="a")
        with pytest.raises(InvalidRequest, match="serves no LoRA adapters"):
            eng.load_lora_adapter("a", "/nowhere")
        assert eng.get_server_info()["kv_whole"]
