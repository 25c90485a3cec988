"""SGLang's generate/API shapes beside our own: weight_versions spans and the OpenAI metadata
block, labels kept by unnamed updates, /get_model_info following a disk update, /v1/loads,
streaming batches and n > 1 with an index, and the OpenAI fields echo+logprobs, logit_bias,
suffix."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest
from server_helpers import start_server, stop_server

from rollout.engine.engine import RolloutEngine
from rollout.engine.output_builder import version_spans

PROMPT = [5, 17, 42, 99, 123, 7]
LONG = {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cpu") as eng:
        yield eng


@pytest.fixture(scope="module")
def server(tiny_qwen3, tiny_qwen3_perturbed):
    roots = ["--allowed-weight-roots", os.path.dirname(tiny_qwen3)]
    roots += ["--allowed-weight-roots", os.path.dirname(tiny_qwen3_perturbed)]
    proc, url = start_server(tiny_qwen3, "--served-model-name", "tiny", *roots)
    yield url
    stop_server(proc)


def _change(offset: int, label: str, previous: str) -> dict:
    return {"offset": offset, "weight_version": label, "previous": previous}


@pytest.mark.parametrize(
    "changes, current, n, spans",
    [
        ([], "a", 5, [("a", 0, 5)]),
        ([], "a", 0, [("a", 0, 0)]),
        ([_change(2, "b", "a")], "b", 5, [("a", 0, 2), ("b", 2, 5)]),
        ([_change(0, "b", "a")], "b", 3, [("b", 0, 3)]),  # KV computed, no token yet
        ([_change(2, "a", "a")], "a", 4, [("a", 0, 4)]),  # an update that kept the label
        ([_change(2, "b", "a"), _change(2, "a", "b")], "a", 4, [("a", 0, 4)]),
        ([_change(1, "b", "a"), _change(3, "c", "b")], "c", 6, [("a", 0, 1), ("b", 1, 3), ("c", 3, 6)]),
        ([_change(4, "b", "a")], "b", 4, [("a", 0, 4)]),  # changed after its last token
        ([_change(9, "b", "a")], "b", 4, [("a", 0, 4)]),
    ],
)
def test_version_spans_cover_the_output_in_order(changes, current, n, spans):
    got = version_spans(changes, current, n)
    assert [(s["version"], s["start"], s["end"]) for s in got] == spans


def _update_midway(engine, path: str, version: str | None, at: int = 20) -> dict:
    """A long greedy stream during which the weights are reloaded from `path`; its last output."""
    done = False
    for out in engine.generate(input_ids=PROMPT, sampling_params=LONG, stream=True):
        if len(out["output_ids"]) >= at and not done:
            engine.update_weights_from_disk(path, weight_version=version)
            done = True
    return out


def test_weight_versions_spans_split_the_output_where_the_version_changed(
    engine, tiny_qwen3, tiny_qwen3_perturbed
):
    engine.update_weights_from_disk(tiny_qwen3, weight_version="old")
    out = _update_midway(engine, tiny_qwen3_perturbed, "new")
    meta = out["meta_info"]
    [change] = meta["weight_version_changes"]
    k, n = change["offset"], len(out["output_ids"])
    assert change == {"offset": k, "weight_version": "new"} and 20 <= k < n == 300
    assert meta["weight_versions"] == [
        {"version": "old", "start": 0, "end": k},
        {"version": "new", "start": k, "end": n},
    ]
    assert meta["weight_version"] == "new"
    quiet = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 3})["meta_info"]
    assert quiet["weight_versions"] == [{"version": "new", "start": 0, "end": 3}]


def test_an_update_without_a_version_keeps_the_label_but_is_still_recorded(
    engine, tiny_qwen3, tiny_qwen3_perturbed
):
    engine.update_weights_from_disk(tiny_qwen3, weight_version="step-7")
    updates = engine.get_server_info()["weight_updates"]
    result = engine.update_weights_from_disk(tiny_qwen3_perturbed)
    assert result["weight_version"] == "step-7" and engine.get_weight_version() == "step-7"
    assert engine.get_server_info()["weight_updates"] == updates + 1
    out = _update_midway(engine, tiny_qwen3, None)
    meta = out["meta_info"]
    # The weights changed under the request: its changes say where, its spans (labels) can't.
    [change] = meta["weight_version_changes"]
    assert change["weight_version"] == "step-7" and 20 <= change["offset"] < 300
    assert meta["weight_versions"] == [{"version": "step-7", "start": 0, "end": 300}]
    assert engine.update_weight_version("step-8")["weight_version"] == "step-8"
    assert engine.get_server_info()["weight_updates"] == updates + 2  # a relabel changes nothing


def test_model_path_follows_a_disk_update(server, tiny_qwen3, tiny_qwen3_perturbed):
    with httpx.Client(base_url=server, timeout=60) as http:
        assert http.get("/get_model_info").json()["model_path"] == tiny_qwen3
        r = http.post("/update_weights_from_disk", json={"model_path": tiny_qwen3_perturbed})
        assert r.status_code == 200, r.text
        assert http.get("/get_model_info").json()["model_path"] == tiny_qwen3_perturbed
        assert http.get("/get_server_info").json()["model_path"] == tiny_qwen3_perturbed
        r = http.post("/update_weights_from_disk", json={"model_path": tiny_qwen3})
        assert r.status_code == 200, r.text
        assert http.get("/get_model_info").json()["model_path"] == tiny_qwen3


def test_v1_loads_reports_each_rank_and_their_aggregate(server):
    body = httpx.get(f"{server}/v1/loads", params={"include": "core,queues"}).json()
    assert body["dp_rank_count"] == 1 and isinstance(body["timestamp"], str)
    [load] = body["loads"]
    for key in ("num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens",
                "max_total_num_tokens"):  # fmt: skip
        assert isinstance(load[key], int)
    assert load["dp_rank"] == 0 and load["max_total_num_tokens"] == 8192
    assert 0 <= load["token_usage"] <= 1
    assert body["aggregate"]["total_reqs"] == load["num_total_reqs"]
    [only] = httpx.get(f"{server}/v1/loads", params={"dp_rank": 0}).json()["loads"]
    assert only["dp_rank"] == 0
    assert httpx.get(f"{server}/v1/loads", params={"dp_rank": 1}).status_code == 400


def _stream(server: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{server}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


@pytest.mark.parametrize(
    "body",
    [
        {"text": ["Hello there", "The sky is"], "sampling_params": {"max_new_tokens": 6, "seed": 3}},
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "n": 3, "seed": 9}},
        {
            "input_ids": [PROMPT, PROMPT[:4]],
            "sampling_params": [
                {"max_new_tokens": 5, "n": 2, "sampling_seed": 1},
                {"max_new_tokens": 3, "n": 2, "seed": 5},
            ],
            "return_logprob": True,
        },
    ],
)
def test_streaming_a_batch_or_n_gives_every_sample_with_its_index(server, body):
    whole = httpx.post(f"{server}/generate", json=body, timeout=60).json()
    events = _stream(server, {**body, "stream": True})
    last = {}
    for event in events:
        last[event["index"]] = event
    assert sorted(last) == list(range(len(whole)))
    for i, out in enumerate(whole):
        assert last[i]["output_ids"] == out["output_ids"]
        assert last[i]["meta_info"]["finish_reason"] == out["meta_info"]["finish_reason"]
    assert len(events) > len(whole)  # streamed as they grow, not each whole at the end


def test_streaming_a_batch_refuses_bad_input_before_the_stream(server):
    body = {"input_ids": [PROMPT, [10**9]], "stream": True}
    r = httpx.post(f"{server}/generate", json=body, timeout=60)
    assert r.status_code == 400 and "token ids must be in" in r.json()["error"]["message"]


def test_openai_completion_echo_with_logprobs_and_metadata(server):
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 4, "temperature": 0,
            "echo": True, "logprobs": 2, "suffix": "unused"}  # fmt: skip
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    [choice] = r["choices"]
    lp = choice["logprobs"]
    prompt_len = r["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == prompt_len + 4 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and all(v is not None for v in lp["token_logprobs"][1:])
    assert choice["text"].startswith("Hello world") and "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert r["metadata"]["weight_version"] == r["metadata"]["weight_versions"][0]["version"]
    assert r["metadata"]["weight_versions"][0]["end"] == 4
    streamed = httpx.post(f"{server}/v1/completions", json={**body, "stream": True}, timeout=60)
    chunks = [json.loads(x[6:]) for x in streamed.text.split("\n\n") if x.startswith("data: {")]
    tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert tokens == lp["tokens"]


def test_openai_logit_bias_applies_on_completions_and_chat(server):
    bias = {"77": 100}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0,
            "logit_bias": bias, "logprobs": 0}  # fmt: skip
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    tokens = r["choices"][0]["logprobs"]["tokens"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "temperature": 0, "logit_bias": bias, "logprobs": True}  # fmt: skip
    c = httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=60).json()
    assert [t["token"] for t in c["choices"][0]["logprobs"]["content"]] == tokens
    assert len(set(tokens)) == 1 and "weight_version" in c["metadata"]
    bad = httpx.post(f"{server}/v1/completions", json={**body, "logit_bias": {"1": 300}})
    assert bad.status_code == 400 and "logit_bias" in bad.json()["error"]["message"]


def test_the_engine_streams_a_batch_and_n_with_an_index(engine):
    params = [{"max_new_tokens": 5, "n": 2, "seed": 4}, {"max_new_tokens": 3, "seed": 8}]
    call = {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": params}
    whole = engine.generate(**call)
    last = {}
    for out in engine.generate(**call, stream=True):
        last[out["index"]] = out
    assert [last[i]["output_ids"] for i in range(3)] == [o["output_ids"] for o in whole]

    async def streamed() -> dict:
        got = {}
        async for out in await engine.async_generate(**call, stream=True):
            got[out["index"]] = out
        return got

    got = asyncio.run(streamed())
    assert [got[i]["output_ids"] for i in range(3)] == [o["output_ids"] for o in whole]


def test_model_path_follows_a_staged_disk_update_once_it_commits(engine, tiny_qwen3, tiny_qwen3_perturbed):
    engine.update_weights_from_disk(tiny_qwen3)
    assert engine.get_server_info()["model_path"] == tiny_qwen3
    engine.pause_generation(mode="in_place")
    staged = engine.update_weights_from_disk(tiny_qwen3_perturbed)
    assert staged["staged"] and engine.get_server_info()["model_path"] == tiny_qwen3
    engine.continue_generation()
    assert engine.get_server_info()["model_path"] == tiny_qwen3_perturbed
    engine.pause_generation(mode="in_place")
    engine.update_weights_from_disk(tiny_qwen3)
    engine.discard_staged_weights()
    engine.continue_generation()
    assert engine.get_server_info()["model_path"] == tiny_qwen3_perturbed
