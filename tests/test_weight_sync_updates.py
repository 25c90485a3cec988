"""Weight updates into a running engine through every path, against transformers on the same
weights; failures (bad updates, a trainer dying mid-broadcast) leave the old weights serving
bitwise; versions and the prefix cache across updates. One engine for the module (CPU, fp32)."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hf_reference import hf_greedy
from safetensors.torch import load_file, save_file
from trainer_helpers import doomed_trainer
from transformers import AutoModelForCausalLM

from rollout import RolloutEngine
from rollout.weight_sync import distributed_source
from rollout.weight_sync.sender import WeightSender
from rollout.weight_sync.update_group import UpdateGroup, WeightSyncError

NEW_TOKENS = 10
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 800) for _ in range(n)] for n in (5, 17, 40)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hf_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(path, prompts, NEW_TOKENS)


def _weights(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def expected(tiny_qwen3, tiny_qwen3_perturbed) -> dict[str, list[list[int]]]:
    return {"base": _hf_greedy(tiny_qwen3, PROMPTS), "perturbed": _hf_greedy(tiny_qwen3_perturbed, PROMPTS)}


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cpu") as eng:
        yield eng


def _greedy(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def _exact(engine) -> list:
    """Everything a bitwise comparison needs: tokens and their logprobs. Each prompt runs alone
    and from scratch: batched with others, or over KV from the prefix cache, the same weights
    give the same tokens but not the same last bits."""
    outs = []
    for ids in PROMPTS:
        assert engine.flush_cache()["success"]
        out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        outs.append((out["output_ids"], out["meta_info"]["output_token_logprobs"]))
    return outs


def test_distributed_update_matches_transformers_and_bucketed_equals_per_tensor(
    engine, expected, tiny_qwen3, tiny_qwen3_perturbed
):
    sender = WeightSender(engine, method="distributed")
    sender.init_group("127.0.0.1", _free_port(), backend="gloo", group_name="trainer", timeout_s=30)
    try:
        sender.push(_weights(tiny_qwen3_perturbed), weight_version="dist-1")
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == expected["perturbed"]
        assert {o["meta_info"]["weight_version"] for o in outs} == {"dist-1"}
        sender.push(_weights(tiny_qwen3), weight_version="dist-2", load_format="flattened_bucket")
        assert _greedy(engine) == expected["base"]
        sender.push(_weights(tiny_qwen3_perturbed), load_format="flattened_bucket")
        assert _greedy(engine) == expected["perturbed"]
        assert engine.get_weight_version() == "dist-2"  # unnamed: the label is kept
    finally:
        sender.close()
    assert engine.get_server_info()["weight_update_groups"] == []


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_a_push_the_engine_would_refuse_fails_before_broadcasting_and_keeps_the_group(
    engine, expected, tiny_qwen3, load_format
):
    # Broadcasting a call the engine refuses up front would leave the trainer sending to nobody
    # until the group's timeout, and the group broken on both sides.
    sender = WeightSender(engine, method="distributed")
    sender.init_group("127.0.0.1", _free_port(), backend="gloo", group_name="checked", timeout_s=20)
    try:
        weights = _weights(tiny_qwen3)
        start = time.monotonic()
        with pytest.raises(ValueError, match="weight_version must be a non-empty string"):
            sender.push(weights, weight_version="", load_format=load_format)
        assert time.monotonic() - start < 5  # refused at once, not after the group's timeout
        result = sender.push(weights, weight_version="checked", load_format=load_format)
        assert result["weight_version"] == "checked"
        assert _greedy(engine) == expected["base"]
    finally:
        sender.close()


@pytest.mark.parametrize("stream_buckets", [False, True], ids=["one-call", "streamed"])
def test_tensor_handoff_matches_transformers(engine, expected, tiny_qwen3, tiny_qwen3_perturbed, stream_buckets):
    sender = WeightSender(engine, method="tensor", bucket_bytes=64 << 10, stream_buckets=stream_buckets)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_perturbed, dtype=torch.float32)
    try:
        sender.push(hf, weight_version="tensor-1")  # an nn.Module: its named parameters
        assert _greedy(engine) == expected["perturbed"]
        engine.update_weights_from_tensor(_weights(tiny_qwen3))  # a plain dict works too
        assert _greedy(engine) == expected["base"]
        sender.push(hf, weight_version="tensor-2")  # the kept buckets again
        assert _greedy(engine) == expected["perturbed"]
    finally:
        sender.free_buckets()
    info = engine.get_server_info()
    assert info["weight_version"] == "tensor-2" and info["generation_paused"] is None


def test_disk_reload_matches_transformers(engine, expected, tiny_qwen3, tiny_qwen3_perturbed):
    result = engine.update_weights_from_disk(tiny_qwen3_perturbed, weight_version="disk-1")
    assert result["success"] and result["weight_version"] == "disk-1"
    assert _greedy(engine) == expected["perturbed"]
    engine.update_weights_from_disk(tiny_qwen3)
    assert _greedy(engine) == expected["base"]


def test_get_weights_by_name_reads_what_was_loaded(engine, tiny_qwen3_perturbed):
    engine.update_weights_from_disk(tiny_qwen3_perturbed)
    want = _weights(tiny_qwen3_perturbed)["model.layers.1.self_attn.k_proj.weight"]  # a fused slice
    got = torch.tensor(engine.get_weights_by_name("model.layers.1.self_attn.k_proj.weight", truncate_size=5))
    assert torch.equal(got, want[:5])
    with pytest.raises(ValueError, match="unknown weight name"):
        engine.get_weights_by_name("model.layers.9.mlp.up_proj.weight")


def _bad_updates(tiny_qwen3, tiny_llama, tmp_path):
    good = _weights(tiny_qwen3)
    lacking = tmp_path / "lacking"
    shutil.copytree(tiny_qwen3, lacking)
    save_file({k: v for k, v in good.items() if "layers.1." not in k}, str(lacking / "model.safetensors"))
    wrong_dtype = dict(good, **{"model.norm.weight": good["model.norm.weight"].half()})
    tail_wrong = list(good.items()) + [("model.norm.weight_extra", torch.zeros(1))]
    return {
        "unknown name": (lambda e: e.update_weights_from_tensor([("model.layers.7.mlp.up_proj.weight", torch.zeros(128, 64))]), "unknown weight name"),
        "shape": (lambda e: e.update_weights_from_tensor({"model.norm.weight": torch.zeros(3)}), r"must be \[64\], got \[3\]"),
        "dtype": (lambda e: e.update_weights_from_tensor(wrong_dtype), "must be float32, got float16"),
        "one bad among many": (lambda e: e.update_weights_from_tensor(tail_wrong), "unknown weight name"),
        "other network": (lambda e: e.update_weights_from_disk(tiny_llama), "different network"),
        "incomplete checkpoint": (lambda e: e.update_weights_from_disk(str(lacking)), "lacks"),
        "not a checkpoint": (lambda e: e.update_weights_from_disk(str(tmp_path)), "config.json"),
    }


def test_bad_updates_change_nothing_and_the_next_good_one_works(
    engine, expected, tiny_qwen3, tiny_qwen3_perturbed, tiny_llama, tmp_path
):
    engine.update_weights_from_tensor(_weights(tiny_qwen3), weight_version="good")
    before = _exact(engine)
    for label, (update, message) in _bad_updates(tiny_qwen3, tiny_llama, tmp_path).items():
        with pytest.raises(ValueError, match=message):
            update(engine)
        assert _exact(engine) == before, label
        assert engine.get_weight_version() == "good", label
    engine.update_weights_from_disk(tiny_qwen3_perturbed)
    assert _greedy(engine) == expected["perturbed"]


def test_refused_distributed_update_drains_the_broadcast_and_keeps_the_group(engine, expected, tiny_qwen3):
    weights = _weights(tiny_qwen3)
    engine.update_weights_from_tensor(weights, weight_version="before")
    before = _exact(engine)
    port, pool = _free_port(), ThreadPoolExecutor(1)
    joined = pool.submit(engine.init_weights_update_group, "127.0.0.1", port, 1, 2, "refuse", "gloo", 30)
    group = UpdateGroup.join("127.0.0.1", port, 0, 2, "refuse", "gloo", 30)
    joined.result()
    named = list(weights.items())
    named[3] = (named[3][0], torch.zeros(2, 2))  # a wrong shape, somewhere in the middle
    call = pool.submit(
        engine.update_weights_from_distributed,
        [n for n, _ in named], ["float32"] * len(named), [list(t.shape) for _, t in named], "refuse",
    )  # fmt: skip
    distributed_source.send(group, named, None)  # completes: the engine takes every broadcast
    with pytest.raises(ValueError, match="shape mismatch"):
        call.result(timeout=30)
    assert _exact(engine) == before and engine.get_weight_version() == "before"
    good = list(weights.items())
    call = pool.submit(
        engine.update_weights_from_distributed,
        [n for n, _ in good], ["float32"] * len(good), [list(t.shape) for _, t in good], "refuse",
        weight_version="after",
    )  # fmt: skip
    distributed_source.send(group, good, None)
    assert call.result(timeout=30)["weight_version"] == "after"
    assert _greedy(engine) == expected["base"]
    group.close()
    engine.destroy_weights_update_group("refuse")


@pytest.mark.parametrize("fate", ["killed", "stalled", "killed-flattened"])
def test_trainer_failing_mid_broadcast_leaves_the_old_weights(engine, expected, tiny_qwen3, fate):
    # A flattened bucket is written only once its one broadcast has all arrived (no backup).
    weights = _weights(tiny_qwen3)
    engine.update_weights_from_tensor(weights, weight_version="safe")
    before = _exact(engine)
    names, shapes = list(weights), [list(t.shape) for t in weights.values()]
    flat = fate.endswith("flattened")
    sends = [] if flat else shapes[: len(shapes) // 2]
    ctx, port = mp.get_context("spawn"), _free_port()
    ready, sent = ctx.Event(), ctx.Event()
    trainer = ctx.Process(target=doomed_trainer, args=(port, 2, sends, ready, sent), daemon=True)
    trainer.start()
    try:
        assert ready.wait(60)
        timeout_s = 2.0
        engine.init_weights_update_group("127.0.0.1", port, 1, 2, "doomed", "gloo", timeout_s=timeout_s)
        call = ThreadPoolExecutor(1).submit(
            engine.update_weights_from_distributed, names, ["float32"] * len(names), shapes, "doomed",
            load_format="flattened_bucket" if flat else None,
        )  # fmt: skip
        assert sent.wait(30)
        start = time.monotonic()
        if fate.startswith("killed"):
            os.kill(trainer.pid, signal.SIGKILL)
        with pytest.raises(WeightSyncError, match="rolled back") as err:
            call.result(timeout=60)
        assert time.monotonic() - start < timeout_s + 5
        assert "doomed" in str(err.value) and "'safe' are unchanged" in str(err.value)
    finally:
        trainer.kill()
        trainer.join()
    assert _exact(engine) == before and engine.get_weight_version() == "safe"  # still serving
    with pytest.raises(ValueError, match="no open weight update group 'doomed'"):
        engine.update_weights_from_distributed(names[:1], ["float32"], shapes[:1], "doomed")
    info = engine.get_server_info()  # listed as closed, not as one updates can use
    assert (info["weight_update_groups"], info["weight_update_groups_closed"]) == ([], ["doomed"])
    engine.destroy_weights_update_group("doomed")
    assert engine.get_server_info()["weight_update_groups_closed"] == []
    engine.update_weights_from_disk(tiny_qwen3, weight_version="next")  # the next good one works
    assert _greedy(engine) == expected["base"]


def test_a_request_spanning_an_update_reports_where_the_version_changed(engine, tiny_qwen3, tiny_qwen3_perturbed):
    engine.update_weights_from_disk(tiny_qwen3, weight_version="old")
    params = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
    prompt = PROMPTS[1]
    reference = engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    seen, updated = 0, False
    for chunk in engine.generate(input_ids=prompt, sampling_params=params, stream=True):
        seen = len(chunk["output_ids"])
        if seen >= 20 and not updated:
            engine.update_weights_from_disk(tiny_qwen3_perturbed, weight_version="new")
            updated = True
    meta = chunk["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and seen == 400
    assert meta["weight_version"] == "new"
    [change] = meta["weight_version_changes"]
    k = change["offset"]
    assert change["weight_version"] == "new" and 20 <= k < 400
    assert chunk["output_ids"][:k] == reference[:k]  # before the change: the old weights
    assert chunk["output_ids"] != reference
    # Its KV (partly from the old weights) was never cached: the same prompt starts afresh.
    quiet = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert quiet["meta_info"]["weight_version_changes"] == []
    assert quiet["meta_info"]["cached_tokens"] == 0
    info = engine.get_server_info()
    assert info["kv_whole"] and info["kv_stale"] == 0


def test_relabel_keeps_requests_unless_asked_to_abort(engine):
    params = {"max_new_tokens": 300, "ignore_eos": True}

    def relabel_midway(version: str, abort: bool) -> dict:
        done = False
        for chunk in engine.generate(input_ids=PROMPTS[0], sampling_params=params, stream=True):
            if len(chunk["output_ids"]) >= 5 and not done:
                engine.update_weight_version(version, abort_all_requests=abort)
                done = True
        return chunk["meta_info"]

    kept = relabel_midway("relabelled", abort=False)
    assert kept["finish_reason"]["type"] == "length" and kept["weight_version"] == "relabelled"
    assert [c["weight_version"] for c in kept["weight_version_changes"]] == ["relabelled"]
    aborted = relabel_midway("relabelled-2", abort=True)
    assert aborted["finish_reason"]["type"] == "abort"
    assert engine.get_weight_version() == "relabelled-2"
    # Every token of the aborted request came before the relabel: its outputs say so.
    assert aborted["weight_version"] == "relabelled" and aborted["weight_version_changes"] == []
    assert {span["version"] for span in aborted["weight_versions"]} == {"relabelled"}


@pytest.mark.parametrize("path", ["disk", "tensor"])
def test_requests_aborted_by_an_update_carry_the_version_they_ran_under(engine, tiny_qwen3, path):
    engine.update_weights_from_disk(tiny_qwen3, weight_version="before")
    params = {"max_new_tokens": 300, "ignore_eos": True}
    done = False
    for chunk in engine.generate(input_ids=PROMPTS[0], sampling_params=params, stream=True):
        if len(chunk["output_ids"]) >= 5 and not done:
            if path == "disk":
                engine.update_weights_from_disk(tiny_qwen3, weight_version="after", abort_all_requests=True)
            else:
                engine.update_weights_from_tensor(_weights(tiny_qwen3), weight_version="after", abort_all_requests=True)
            done = True
    meta = chunk["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and 5 <= meta["completion_tokens"] < 300
    assert meta["weight_version"] == "before" and meta["weight_version_changes"] == []
    assert [s["version"] for s in meta["weight_versions"]] == ["before"]
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["meta_info"]["weight_version"] == "after"


def test_prefix_cache_is_never_reused_across_an_update(engine, tiny_qwen3, tiny_qwen3_perturbed):
    engine.update_weights_from_disk(tiny_qwen3)
    prompt = [_rng.randrange(3, 800) for _ in range(150)]
    engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert engine.generate(input_ids=prompt, sampling_params=GREEDY)["meta_info"]["cached_tokens"] >= 140
    engine.update_weights_from_disk(tiny_qwen3_perturbed)
    fresh = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert fresh["meta_info"]["cached_tokens"] == 0
    assert fresh["output_ids"] == _hf_greedy(tiny_qwen3_perturbed, [prompt])[0]
    assert engine.generate(input_ids=prompt, sampling_params=GREEDY)["meta_info"]["cached_tokens"] >= 140
    info = engine.get_server_info()
    assert info["kv_whole"] and info["kv_stale"] == 0
