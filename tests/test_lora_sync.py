"""Adapter weight sync (CPU, float32, tiny Qwen3) against PEFT: new values of a loaded LoRA
adapter pushed through each path (tensor handoff, a gloo broadcast, a PEFT directory on disk,
WeightSender with a PeftModel) serve PEFT's greedy tokens and logprobs of the new adapter, with
the version the push named and no KV of the older values reused; a partial update changes only
its modules; a refused update (wrong shape, unknown module, half a module, unknown adapter)
changes nothing; while paused, updates wait for continue_generation or are discarded."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
import torch
from hf_reference import greedy_of
from lora_helpers import make_peft_adapter, peft_model
from safetensors.torch import load_file, save_file
from server_helpers import free_port

from rollout import RolloutEngine
from rollout.errors import InvalidRequest

pytest.importorskip("peft")

NEW = 6
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
PROMPT = list(range(60, 90))
R, ALPHA = 4, 8
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def adapters(tiny_qwen3, tmp_path_factory):
    """PEFT directories of one layout with different values: "a" is loaded, the others are
    what a trainer pushes."""
    root = tmp_path_factory.mktemp("lora-sync")
    return {
        name: make_peft_adapter(tiny_qwen3, str(root / name), R, ALPHA, TARGETS, seed=20 + i)
        for i, name in enumerate(["a", "t", "d", "k", "s", "p"])
    }


@pytest.fixture(scope="module")
def engine(tiny_qwen3, adapters):
    with RolloutEngine(
        tiny_qwen3, dtype="float32", device="cpu", max_total_tokens=2048,
        lora_paths=[f"a={adapters['a']}"], max_lora_rank=8, max_loras_per_batch=2,
    ) as eng:  # fmt: skip
        yield eng


def tensors_of(directory: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(directory, "adapter_model.safetensors"))


def generate(engine, lora="a", prompt=PROMPT) -> dict:
    return engine.generate(
        input_ids=prompt, sampling_params=GREEDY, lora_path=lora, return_logprob=True
    )


def assert_serves(out: dict, base: str, adapter_dir: str, prompt=PROMPT) -> None:
    """`out` has PEFT's greedy tokens with `adapter_dir`, and its logprobs within 1e-4."""
    model = peft_model(base, adapter_dir)
    assert out["output_ids"] == greedy_of(model, [prompt], NEW)[0]
    full = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(full).logits[0].float(), -1)
    want = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out["output_ids"])]
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(want, abs=1e-4)


def versions(engine) -> dict[str, str]:
    return engine.get_server_info()["lora_weight_versions"]


def test_tensor_sync_serves_the_new_adapter_with_its_version_and_fresh_kv(
    engine, adapters, tiny_qwen3
):
    generate(engine)  # the prompt's KV under the loaded values
    assert generate(engine)["meta_info"]["cached_tokens"] > 0
    base_version = engine.get_weight_version()
    named = list(tensors_of(adapters["t"]).items())
    result = engine.update_weights_from_tensor(named, weight_version="t-1", lora_name="a")
    assert result["weight_version"] == "t-1"
    out = generate(engine)
    assert out["meta_info"]["cached_tokens"] == 0  # KV of the older values is not reused
    assert out["meta_info"]["weight_version"] == "t-1"
    assert_serves(out, tiny_qwen3, adapters["t"])
    assert generate(engine)["meta_info"]["cached_tokens"] > 0  # the new values' KV is
    # The base model's weights and version are untouched.
    assert engine.get_weight_version() == base_version
    base = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert base["meta_info"]["weight_version"] == base_version
    assert base["output_ids"] == greedy_of(peft_model(tiny_qwen3, None), [PROMPT], NEW)[0]


def test_distributed_sync_over_gloo_serves_the_new_adapter(engine, adapters, tiny_qwen3):
    from rollout.weight_sync.sender import WeightSender

    sender = WeightSender(engine, method="distributed")
    sender.init_group("127.0.0.1", free_port(), backend="gloo", group_name="lora", timeout_s=60)
    try:
        # Names without PEFT's base_model.model. prefix are the same weights.
        named = {n.removeprefix(PREFIX): t for n, t in tensors_of(adapters["d"]).items()}
        sender.push(named, weight_version="d-1", lora_name="a")
        out = generate(engine)
        assert out["meta_info"]["weight_version"] == "d-1"
        assert out["meta_info"]["cached_tokens"] == 0
        assert_serves(out, tiny_qwen3, adapters["d"])
        # A refused broadcast is still taken: the group serves the next push.
        bad = {**named, next(iter(named)): torch.zeros(3, 3)}
        with pytest.raises(ValueError, match="has shape"):
            sender.push(bad, weight_version="d-bad", lora_name="a")
        with pytest.raises(ValueError, match="no LoRA adapter named 'zzz'"):
            sender.push(named, weight_version="d-bad", lora_name="zzz")
        assert versions(engine)["a"] == "d-1"
        assert generate(engine)["output_ids"] == out["output_ids"]
        sender.push(
            tensors_of(adapters["k"]),
            weight_version="d-2",
            load_format="flattened_bucket",
            lora_name="a",
        )
        assert_serves(generate(engine), tiny_qwen3, adapters["k"])
    finally:
        sender.close()


def test_disk_sync_replaces_the_adapter_from_a_peft_directory(
    engine, adapters, tiny_qwen3, tmp_path
):
    result = engine.update_weights_from_disk(adapters["k"], weight_version="k-1", lora_name="a")
    assert result.info["weight_version"] == "k-1"
    out = generate(engine)
    assert out["meta_info"]["weight_version"] == "k-1" and out["meta_info"]["cached_tokens"] == 0
    assert_serves(out, tiny_qwen3, adapters["k"])
    # A directory replaces the adapter whole: another rank and modules are a new adapter.
    other = make_peft_adapter(
        tiny_qwen3, str(tmp_path / "r8"), 8, 16, ["q_proj", "down_proj"], seed=5
    )
    engine.update_weights_from_disk(other, weight_version="k-2", lora_name="a")
    assert_serves(generate(engine), tiny_qwen3, other)
    engine.update_weights_from_disk(adapters["a"], lora_name="a")  # back to the loaded layout
    assert versions(engine)["a"] == "k-2"  # no version named: the label is kept


def test_a_partial_update_changes_only_its_modules(engine, adapters, tiny_qwen3, tmp_path):
    engine.update_weights_from_disk(adapters["a"], weight_version="p-0", lora_name="a")
    new = tensors_of(adapters["p"])
    module = f"{PREFIX}model.layers.0.self_attn.q_proj"
    part = {k: v for k, v in new.items() if k.startswith(module + ".")}
    assert len(part) == 2
    engine.update_weights_from_tensor(part, weight_version="p-1", lora_name="a")
    # What PEFT serves: the loaded adapter with that one module's values replaced.
    merged = str(tmp_path / "merged")
    shutil.copytree(adapters["a"], merged)
    save_file(
        {**tensors_of(adapters["a"]), **part}, os.path.join(merged, "adapter_model.safetensors")
    )
    assert_serves(generate(engine), tiny_qwen3, merged)


def test_refused_updates_change_nothing(engine, adapters, tiny_qwen3, tmp_path):
    engine.update_weights_from_disk(adapters["a"], weight_version="r-0", lora_name="a")
    before = generate(engine)
    good = tensors_of(adapters["t"])
    a_name = f"{PREFIX}model.layers.1.self_attn.q_proj.lora_A.weight"
    k_name = a_name.replace("q_proj", "k_proj")  # a projection "a" does not adapt
    cases = {
        "has shape": {**good, a_name: good[a_name].T.contiguous()},
        "has no LoRA weights on": {**good, k_name: good[a_name]},
        "without its lora_B": {a_name: good[a_name]},
        "unexpected tensor": {**good, "model.embed_tokens.weight": torch.zeros(4, 4)},
        "must be floating-point": {**good, a_name: good[a_name].to(torch.int32)},
    }
    for message, named in cases.items():
        with pytest.raises(InvalidRequest, match=message):
            engine.update_weights_from_tensor(named, weight_version="r-bad", lora_name="a")
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'zzz'"):
        engine.update_weights_from_tensor(good, weight_version="r-bad", lora_name="zzz")
    big = make_peft_adapter(tiny_qwen3, str(tmp_path / "big"), 16, 16, ["q_proj"], seed=3)
    with pytest.raises(InvalidRequest, match="rank 16 is above max_lora_rank 8"):
        engine.update_weights_from_disk(big, weight_version="r-bad", lora_name="a")
    broken = tmp_path / "broken"
    shutil.copytree(adapters["t"], broken)
    (broken / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"], "use_dora": True})
    )
    with pytest.raises(InvalidRequest, match="DoRA"):
        engine.update_weights_from_disk(str(broken), lora_name="a")
    assert versions(engine)["a"] == "r-0"
    after = generate(engine)
    assert after["output_ids"] == before["output_ids"]
    # (Up to rounding: `after` reads the prompt's KV from the cache.)
    logprobs = [
        [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in (before, after)
    ]
    assert logprobs[1] == pytest.approx(logprobs[0], abs=1e-5)
    assert after["meta_info"]["cached_tokens"] > 0  # nothing was published: the KV stands


def test_while_paused_updates_wait_for_continue_or_are_discarded(engine, adapters, tiny_qwen3):
    engine.update_weights_from_disk(adapters["a"], weight_version="w-0", lora_name="a")
    before = generate(engine)
    for mode in ("in_place", "retract"):
        engine.pause_generation(mode=mode)
        staged = engine.update_weights_from_tensor(
            tensors_of(adapters["s"]), weight_version="w-bad", lora_name="a"
        )
        assert staged["staged"] and engine.get_server_info()["lora_update_staged"] == 1
        assert engine.discard_staged_weights()["discarded"] == 1
        engine.continue_generation()
        assert versions(engine)["a"] == "w-0"
        assert generate(engine)["output_ids"] == before["output_ids"]
    engine.pause_generation(mode="in_place")
    engine.update_weights_from_tensor(
        tensors_of(adapters["s"]), weight_version="w-1", lora_name="a"
    )
    assert versions(engine)["a"] == "w-0"  # not yet
    done = engine.continue_generation()
    assert done["lora_weight_versions"] == {"a": "w-1"}
    out = generate(engine)
    assert out["meta_info"]["weight_version"] == "w-1" and out["meta_info"]["cached_tokens"] == 0
    assert_serves(out, tiny_qwen3, adapters["s"])


def test_an_update_refused_while_paused_drops_every_staged_one(engine, adapters, tiny_qwen3):
    engine.update_weights_from_disk(adapters["a"], weight_version="x-0", lora_name="a")
    before = generate(engine)
    good = tensors_of(adapters["s"])
    name = next(iter(good))
    bad_adapter = {**good, name: torch.zeros(3)}
    bad_base = {"model.norm.weight": torch.zeros(5)}
    for refused, kw in ((bad_adapter, {"lora_name": "a"}), (bad_base, {})):
        engine.pause_generation(mode="in_place")
        assert engine.update_weights_from_tensor(good, weight_version="x-1", lora_name="a")["staged"]
        with pytest.raises(ValueError, match="every update staged since the pause was rolled back"):
            engine.update_weights_from_tensor(refused, **kw)
        assert engine.get_server_info()["lora_update_staged"] == 0
        engine.continue_generation()
        assert versions(engine)["a"] == "x-0"
        assert generate(engine)["output_ids"] == before["output_ids"]


def test_weight_sender_pushes_only_the_adapter_of_a_peft_model(
    engine, adapters, tiny_qwen3, tmp_path
):
    from rollout.weight_sync.sender import WeightSender

    policy = peft_model(tiny_qwen3, adapters["t"])
    cases = [
        ("tensor", {}),
        # Buckets of a few tensors, one call each while paused: the update applies whole.
        ("tensor", {"stream_buckets": True, "bucket_bytes": 3000}),
        ("disk", {"disk_dir": str(tmp_path / "push")}),
    ]
    for method, kw in cases:
        engine.update_weights_from_disk(adapters["a"], weight_version="0", lora_name="a")
        sender = WeightSender(engine, method=method, **kw)
        try:
            with pytest.raises(ValueError, match="pass lora_name"):
                sender.push(policy)
            result = sender.push(policy, weight_version=f"{method}-1", lora_name="a")
            info = getattr(result, "info", result)  # continue_generation's when streamed
            assert info.get("lora_name") == "a" or info["lora_weight_versions"] == {"a": f"{method}-1"}
        finally:
            sender.close()
        out = generate(engine)
        assert out["meta_info"]["weight_version"] == f"{method}-1"
        assert_serves(out, tiny_qwen3, adapters["t"])
    assert sorted(os.listdir(tmp_path / "push")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert engine.get_server_info()["kv_whole"]


def test_a_request_running_across_an_update_says_where_its_adapter_changed(
    engine, adapters, tiny_qwen3
):
    engine.update_weights_from_disk(adapters["a"], weight_version="f-0", lora_name="a")

    async def scenario():
        params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
        stream = await engine.async_generate(
            input_ids=PROMPT, sampling_params=params, lora_path="a", stream=True
        )
        await stream.__anext__()
        engine.update_weights_from_tensor(
            tensors_of(adapters["t"]), weight_version="f-1", lora_name="a"
        )
        outs = [out async for out in stream]
        return outs[-1]

    meta = asyncio.run(scenario())["meta_info"]
    assert meta["weight_version"] == "f-1"
    [change] = meta["weight_version_changes"]
    assert change["weight_version"] == "f-1" and 0 < change["offset"] < 64
    assert [s["version"] for s in meta["weight_versions"]] == ["f-0", "f-1"]
    # A base-model update keeps an adapter request's label (its adapter's); base requests
    # carry the base model's.
    named = list(load_file(os.path.join(tiny_qwen3, "model.safetensors")).items())
    engine.update_weights_from_tensor(named, weight_version="base-1")
    assert generate(engine)["meta_info"]["weight_version"] == "f-1"
    base = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert base["meta_info"]["weight_version"] == "base-1"


def test_repeated_pushes_serve_each_new_adapter_and_a_reloaded_one_is_checked_afresh(
    engine, adapters, tiny_qwen3, tmp_path
):
    from rollout.weight_sync.sender import WeightSender

    engine.update_weights_from_disk(adapters["a"], weight_version="c-0", lora_name="a")
    sender = WeightSender(engine, method="tensor", lora_name="a")
    try:
        # The same names and shapes every push, as a trainer sends them step after step.
        for step, name in enumerate(["t", "s", "t"], start=1):
            sender.push(tensors_of(adapters[name]), weight_version=f"c-{step}")
            out = generate(engine)
            assert out["meta_info"]["weight_version"] == f"c-{step}"
            assert_serves(out, tiny_qwen3, adapters[name])
        # The adapter loaded again under its name at another rank: values of the old rank
        # are refused, values of the new one serve.
        r8 = make_peft_adapter(tiny_qwen3, str(tmp_path / "r8"), 8, 16, TARGETS, seed=8)
        r8_new = make_peft_adapter(tiny_qwen3, str(tmp_path / "r8-new"), 8, 16, TARGETS, seed=9)
        engine.unload_lora_adapter("a")
        engine.load_lora_adapter("a", r8)
        with pytest.raises(InvalidRequest, match="has shape"):
            sender.push(tensors_of(adapters["t"]), weight_version="c-bad")
        sender.push(tensors_of(r8_new), weight_version="c-4")
        assert_serves(generate(engine), tiny_qwen3, r8_new)
    finally:
        sender.close()
        engine.update_weights_from_disk(adapters["a"], lora_name="a")  # back to rank R
