"""Pausing generation (abort, retract, in place) and releasing memory, with requests in flight;
updates while paused apply together or not at all. One engine for the module (CPU, fp32)."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollout import RolloutEngine

_rng = random.Random(1)
PROMPTS = [[_rng.randrange(3, 800) for _ in range(n)] for n in (6, 23, 41)]
LONG = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
KV_TOKENS = 131072  # 4 K/V tensors of 32 MiB: freed straight back to the OS by malloc


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cpu", max_total_tokens=KV_TOKENS) as eng:
        yield eng


def _weights(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def _wait_for(engine, test, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = engine.get_server_info()
        if test(info):
            return info
        time.sleep(0.01)
    raise AssertionError(f"condition not reached: {engine.get_server_info()}")


async def _start(engine, prompts, params) -> list[asyncio.Task]:
    start = engine.get_server_info()["generated_tokens"]
    tasks = [asyncio.ensure_future(engine.async_generate(input_ids=p, sampling_params=params)) for p in prompts]
    # Every request running, each with a few tokens out.
    await asyncio.to_thread(
        _wait_for, engine,
        lambda i: i["num_running"] == len(prompts) and i["generated_tokens"] - start >= 5 * len(prompts),
    )  # fmt: skip
    return tasks


@functools.cache
def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_continue(path: str, ids: list[int], n: int) -> list[int]:
    hf = _hf(path)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def _exact(engine) -> list:
    """Tokens and logprobs of each prompt alone, computed from scratch (bitwise comparable)."""
    outs = []
    for ids in PROMPTS:
        assert engine.flush_cache()["success"]
        out = engine.generate(input_ids=ids, sampling_params={**LONG, "max_new_tokens": 8}, return_logprob=True)
        outs.append((out["output_ids"], out["meta_info"]["output_token_logprobs"]))
    return outs


def test_pause_abort_ends_requests_and_new_ones_wait_for_continue(engine):
    async def run() -> None:
        tasks = await _start(engine, PROMPTS, {**LONG, "max_new_tokens": 3000})
        engine.pause_generation(mode="abort")
        outs = await asyncio.gather(*tasks)
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * 3
        late = asyncio.ensure_future(engine.async_generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 4}))
        await asyncio.sleep(0.3)
        info = engine.get_server_info()
        assert not late.done() and info["num_waiting"] == 1 and info["generation_paused"] == "abort"
        engine.continue_generation()
        assert len((await late)["output_ids"]) == 4

    asyncio.run(run())


def test_pause_retract_requeues_and_reprefills_under_weights_pushed_meanwhile(engine, tiny_qwen3, tiny_qwen3_perturbed):
    engine.update_weights_from_disk(tiny_qwen3, weight_version="before-retract")

    async def run() -> list[dict]:
        tasks = await _start(engine, PROMPTS, LONG)
        engine.pause_generation(mode="retract")
        info = engine.get_server_info()
        assert info["num_running"] == 0 and info["num_waiting"] == 3 and info["kv_in_requests"] == 0
        staged = engine.update_weights_from_disk(tiny_qwen3_perturbed, weight_version="after-retract")
        assert staged["staged"] and engine.get_weight_version() == "before-retract"
        assert engine.continue_generation()["weight_version"] == "after-retract"
        return await asyncio.gather(*tasks)

    for prompt, out in zip(PROMPTS, asyncio.run(run())):
        meta = out["meta_info"]
        [change] = meta["weight_version_changes"]
        k = change["offset"]
        assert change["weight_version"] == meta["weight_version"] == "after-retract" and k >= 5
        # Re-prefilled from scratch under the new weights: exactly what they would continue with.
        ids = prompt + out["output_ids"][:k]
        assert out["output_ids"][k : k + 12] == _hf_continue(tiny_qwen3_perturbed, ids, 12)


def test_pause_in_place_keeps_kv_and_the_update_applies_on_continue(engine, tiny_qwen3, tiny_qwen3_perturbed):
    engine.update_weights_from_disk(tiny_qwen3)

    async def run() -> list[dict]:
        tasks = await _start(engine, PROMPTS, LONG)
        engine.pause_generation(mode="in_place")
        info = engine.get_server_info()
        assert info["num_running"] == 3 and info["kv_in_requests"] > 0
        await asyncio.sleep(0.2)
        assert engine.get_server_info()["generated_tokens"] == info["generated_tokens"]  # nothing steps
        engine.update_weights_from_tensor(_weights(tiny_qwen3_perturbed), weight_version="in-place")
        engine.continue_generation()
        return await asyncio.gather(*tasks)

    for out in asyncio.run(run()):
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert [c["weight_version"] for c in out["meta_info"]["weight_version_changes"]] == ["in-place"]
    info = engine.get_server_info()
    assert info["kv_whole"] and info["kv_stale"] == 0


def test_updates_staged_while_paused_apply_together_or_not_at_all(engine, tiny_qwen3, tiny_qwen3_perturbed):
    engine.update_weights_from_disk(tiny_qwen3, weight_version="v0")
    before = _exact(engine)
    new = list(_weights(tiny_qwen3_perturbed).items())
    first, second = dict(new[: len(new) // 2]), dict(new[len(new) // 2 :])
    engine.pause_generation(mode="in_place")
    assert engine.update_weights_from_tensor(first, weight_version="v1")["staged"]
    with pytest.raises(ValueError, match="every update staged since the pause was rolled back"):
        engine.update_weights_from_tensor({**second, "model.norm.weight": torch.zeros(5)})
    engine.continue_generation()
    assert _exact(engine) == before and engine.get_weight_version() == "v0"

    engine.pause_generation(mode="in_place")
    engine.update_weights_from_tensor(first)
    engine.update_weights_from_tensor(second, weight_version="v1")
    assert engine.get_server_info()["weight_update_staged"] == len(new)
    assert engine.continue_generation()["weight_version"] == "v1"
    for ids, (out, _) in zip(PROMPTS, _exact(engine)):
        assert out == _hf_continue(tiny_qwen3_perturbed, ids, 8)


def test_discarding_staged_updates_restores_the_weights_and_version(engine, tiny_qwen3, tiny_qwen3_perturbed):
    engine.update_weights_from_disk(tiny_qwen3, weight_version="v0")
    before = _exact(engine)
    assert engine.discard_staged_weights()["discarded"] == 0  # nothing staged: nothing to do
    new = _weights(tiny_qwen3_perturbed)
    engine.pause_generation(mode="in_place")
    assert engine.update_weights_from_tensor(new, weight_version="v1")["staged"]
    assert engine.discard_staged_weights()["discarded"] == len(new)
    assert engine.get_server_info()["weight_update_staged"] == 0
    engine.continue_generation()
    assert _exact(engine) == before and engine.get_weight_version() == "v0"


def test_release_with_requests_in_flight_retracts_them_and_they_finish_after_resume(engine, tiny_qwen3):
    engine.update_weights_from_disk(tiny_qwen3)
    reference = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=LONG)]

    async def run() -> list[dict]:
        tasks = await _start(engine, PROMPTS, LONG)
        result = engine.release_memory_occupation()
        assert result["retracted_requests"] == 3
        info = engine.get_server_info()
        assert info["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
        assert info["kv_cache_bytes"] == 0 and info["num_waiting"] == 3
        late = asyncio.ensure_future(engine.async_generate(input_ids=PROMPTS[1], sampling_params=LONG))
        await asyncio.sleep(0.3)
        assert not late.done() and not any(t.done() for t in tasks)
        with pytest.raises(ValueError, match="resume_memory_occupation"):
            engine.update_weights_from_disk(tiny_qwen3)
        engine.resume_memory_occupation()
        return [*(await asyncio.gather(*tasks)), await late]

    outs = asyncio.run(run())
    assert [o["output_ids"] for o in outs] == [*reference, reference[1]]
    assert engine.get_server_info()["memory_released"] == []


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_fifty_release_resume_cycles_keep_memory_flat_and_outputs_unchanged(engine, tiny_qwen3):
    engine.update_weights_from_disk(tiny_qwen3)
    reference = _exact(engine)
    pid = engine._procs[0].pid  # the scheduler, which holds the KV pool
    kv_bytes = engine.get_server_info()["kv_cache_bytes"]
    start = _rss(pid)
    for cycle in range(50):
        engine.release_memory_occupation()
        if cycle == 0:
            assert start - _rss(pid) > 0.8 * kv_bytes  # the pool really went back
        engine.resume_memory_occupation(["kv_cache", "weights", "cuda_graph"])
    assert _rss(pid) < start + 32 * 2**20
    assert _exact(engine) == reference


def test_bad_pause_and_memory_arguments_are_clear_errors(engine):
    with pytest.raises(ValueError, match="mode must be one of abort, retract, in_place"):
        engine.pause_generation(mode="later")
    with pytest.raises(ValueError, match="memory tags must be among"):
        engine.release_memory_occupation(["gpu"])
    with pytest.raises(ValueError, match="tags must be None or a non-empty list"):
        engine.resume_memory_occupation("kv_cache")
    assert engine.get_server_info()["generation_paused"] is None


def test_releasing_twice_or_resuming_what_is_not_released_is_an_error(engine):
    with pytest.raises(ValueError, match="nothing to resume: kv_cache not released"):
        engine.resume_memory_occupation(["kv_cache"])
    engine.release_memory_occupation(["kv_cache"])
    try:
        with pytest.raises(ValueError, match="nothing to release: kv_cache already released"):
            engine.release_memory_occupation(["kv_cache"])
        # Some of the tags still to release: those are released, the others left as they are.
        assert engine.release_memory_occupation()["released"] == ["weights", "cuda_graph"]
    finally:
        engine.resume_memory_occupation()
    assert engine.get_server_info()["memory_released"] == []
