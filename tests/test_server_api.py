"""The HTTP API against the in-process engine: native /generate, OpenAI endpoints (through the
official `openai` package), metrics, models, and RolloutClient's parity with RolloutEngine."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from server_helpers import start_server, stop_server

from rollout import RolloutEngine
from rollout.client import RolloutClient

PROMPTS = ["The quick brown fox", "Once upon a time there was", "1 2 3 4"]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    proc, url = start_server(tiny_qwen3, "--served-model-name", "tiny")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with RolloutEngine(tiny_qwen3, device="cpu", dtype="float32") as e:
        yield e


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


@pytest.fixture(scope="module")
def client(server):
    with RolloutClient(server) as c:
        yield c


def test_native_generate_equals_engine(client, engine):
    got = client.generate(PROMPTS, GREEDY)
    want = engine.generate(PROMPTS, GREEDY)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["text"] for g in got] == [w["text"] for w in want]
    assert got[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert got[0]["meta_info"]["weight_version"] == want[0]["meta_info"]["weight_version"]


def test_native_logprobs_match_engine(client, engine):
    kw = dict(return_logprob=True, top_logprobs_num=3, logprob_start_len=0)
    got = client.generate(PROMPTS[0], GREEDY, **kw)["meta_info"]
    want = engine.generate(PROMPTS[0], GREEDY, **kw)["meta_info"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        assert len(got[key]) == len(want[key]) > 0
        for (g, gid, _), (w, wid, _) in zip(got[key], want[key]):
            assert gid == wid
            assert (g is None and w is None) or abs(g - w) < 1e-5


def test_native_stream_joins_to_the_full_text(client, server):
    full = client.generate(PROMPTS[1], GREEDY)
    chunks = list(client.generate(PROMPTS[1], GREEDY, stream=True))
    assert len(chunks) > 1
    assert chunks[-1]["text"] == full["text"]  # cumulative, as SGLang streams
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    # The raw event stream ends with [DONE].
    with httpx.stream(
        "POST", f"{server}/generate", json={"text": "hi", "sampling_params": GREEDY, "stream": True}
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"


def test_a_stream_read_slowly_gets_its_updates_merged_and_ends_complete(server, client):
    params = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
    body = {"input_ids": [5, 6, 7], "sampling_params": params, "stream": True,
            "return_logprob": True, "top_logprobs_num": 8}  # fmt: skip
    want = client.generate(input_ids=[5, 6, 7], sampling_params=params, return_logprob=True, top_logprobs_num=8)
    with httpx.stream("POST", f"{server}/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()
        events = [next(line for line in lines if line.startswith("data:"))]
        # A slow reader: it reads on only once every token has been made (however slowly this
        # machine makes them); the updates made meanwhile come as fewer, larger events.
        deadline = time.monotonic() + 60
        while httpx.get(f"{server}/get_load").json()[0]["num_reqs"] and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the last updates on their way from the scheduler to the stream
        events += [line for line in lines if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    outs = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert len(outs) < 200, len(outs)  # one event an update would be 401
    for out in outs:  # each event is whole: its entries cover its tokens so far
        meta = out["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == len(out["output_ids"])
    last, full = outs[-1]["meta_info"], want["meta_info"]
    assert outs[-1]["output_ids"] == want["output_ids"]
    assert [e[1] for e in last["output_token_logprobs"]] == want["output_ids"]
    got_lp, want_lp = [e[0] for e in last["output_token_logprobs"]], [e[0] for e in full["output_token_logprobs"]]
    assert got_lp == pytest.approx(want_lp, abs=1e-4)


def test_async_client_equals_sync(client):
    async def run():
        return await asyncio.gather(*(client.async_generate(p, GREEDY) for p in PROMPTS))

    got = asyncio.run(run())
    assert [g["text"] for g in got] == [w["text"] for w in client.generate(PROMPTS, GREEDY)]

    async def stream():
        return [c async for c in await client.async_generate(PROMPTS[0], GREEDY, stream=True)]

    assert asyncio.run(stream())[-1]["text"] == got[0]["text"]


def test_openai_completions_greedy_equals_engine(oai, engine):
    want = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 10})
    resp = oai.completions.create(model="tiny", prompt=PROMPTS, max_tokens=10, temperature=0)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [
        w["text"] for w in want
    ]
    assert resp.usage.completion_tokens == sum(w["meta_info"]["completion_tokens"] for w in want)
    assert resp.usage.prompt_tokens == sum(w["meta_info"]["prompt_tokens"] for w in want)


def test_openai_completions_stream_n2_and_logprobs(oai, engine):
    want = engine.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 8}, return_logprob=True)
    stream = oai.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, n=2, logprobs=2, stream=True
    )
    texts, logprobs, reasons = ["", ""], [[], []], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            logprobs[c.index] += c.logprobs.token_logprobs
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [want["text"]] * 2
    expected = [lp for lp, _, _ in want["meta_info"]["output_token_logprobs"]]
    for got in logprobs:
        assert got == pytest.approx(expected, abs=1e-5)
    assert reasons == ["length", "length"]


def test_openai_chat_equals_engine_through_the_template(oai, engine):
    messages = [{"role": "user", "content": "Say something"}]
    ids = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = engine.generate(
        input_ids=engine.tokenizer.encode(ids, add_special_tokens=False),
        sampling_params={"temperature": 0, "max_new_tokens": 10},
    )
    resp = oai.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want["text"]
    assert len(choice.logprobs.content) == want["meta_info"]["completion_tokens"]
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert resp.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]

    streamed = oai.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in streamed:
        for c in chunk.choices:
            text += c.delta.content or ""
        usage = chunk.usage or usage
    assert text == want["text"]
    assert usage.completion_tokens == want["meta_info"]["completion_tokens"]


def test_openai_stop_ends_the_text(oai):
    free = (
        oai.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0)
        .choices[0]
        .text
    )
    assert len(free) > 4
    stop = free[2:5]
    resp = oai.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop]
    )
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == free[: free.index(stop)]


def test_openai_seeded_sampling_is_reproducible(oai):
    kw = dict(model="tiny", prompt=PROMPTS[2], max_tokens=10, temperature=1.0, seed=7, n=2)
    a = oai.completions.create(**kw)
    b = oai.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_openai_completions_score_the_prompt_with_max_tokens_0_and_echo(oai, engine):
    """The prompt-scoring pattern vLLM allows: its logprobs, nothing generated."""
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=0)
    resp = oai.completions.create(**kw, echo=True, logprobs=0)
    (choice,) = resp.choices
    assert choice.text == PROMPTS[0] and resp.usage.completion_tokens == 0
    params = {"max_new_tokens": 0}
    want = engine.generate(PROMPTS[0], params, return_logprob=True, logprob_start_len=0)
    want_lp = [lp for lp, _, _ in want["meta_info"]["input_token_logprobs"]]
    assert choice.logprobs.token_logprobs[0] is None and want_lp[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want_lp[1:], abs=1e-4)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens must be >= 1 \(0 only with"):
        oai.completions.create(**kw)  # no echo: nothing to return


def test_openai_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError, match="not served"):
        oai.completions.create(model="gpt-4", prompt="hi", max_tokens=2)


def test_models_endpoints(oai, server):
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    assert oai.models.retrieve("tiny").id == "tiny"
    assert httpx.get(f"{server}/v1/models/other").status_code == 404


def test_health_info_and_load(server, client):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server}/health_generate").status_code == 200
    info = client.get_model_info()
    assert info["is_generation"] and info["served_model_name"] == "tiny"
    load = httpx.get(f"{server}/get_load").json()
    assert load[0]["num_reqs"] == 0
    assert client.get_server_info()["kv_whole"] is True


def test_metrics_count_requests_and_tokens(server, client):
    before = httpx.get(f"{server}/metrics").text
    client.generate("metrics please", {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0})
    after = httpx.get(f"{server}/metrics").text

    def value(text: str, name: str) -> float:
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith(name + " ") or line.startswith(name + "{")
        )

    assert (
        value(after, "rollout_generation_tokens_total")
        - value(before, "rollout_generation_tokens_total")
        == 5
    )
    assert value(after, "rollout_requests_total") > value(before, "rollout_requests_total")
    for name in (
        "rollout_e2e_request_latency_seconds_bucket",
        "rollout_num_queue_reqs",
        "rollout_kv_cache_usage",
        "rollout_prefix_cache_hit_rate",
    ):
        assert name in after


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"text": "hi", "sampling_params": {"n": 0}}, "n must"),
        ({"text": "hi", "sampling_params": {"bogus": 1}}, "bogus"),
        ({"input_ids": [10**9]}, "token ids"),
        ({"text": ""}, "empty"),
        ({"text": "hi", "top_logprobs_num": -2}, "top_logprobs_num"),
        ({"text": "hi", "token_ids_logprob": [10**9], "return_logprob": True}, "token_ids_logprob"),
        ({"text": 5}, "text"),
        ({"text": "hi", "unknown_field": 1}, "unknown_field"),
        # Not converted: the Python API refuses these too.
        ({"text": "hi", "stream": "yes"}, "stream"),
        ({"text": "hi", "return_logprob": "yes"}, "return_logprob"),
        ({"text": "hi", "return_logprob": True, "logprob_start_len": "0"}, "logprob_start_len"),
    ],
)
def test_bad_input_is_a_400_naming_the_problem(server, body, fragment):
    resp = httpx.post(f"{server}/generate", json=body)
    assert resp.status_code == 400, resp.text
    assert fragment in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    "path, body, fragment",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**7}, "max_tokens must be <="),
        ("/v1/chat/completions", {"max_tokens": 10**7}, "max_tokens must be <="),
        ("/v1/chat/completions", {"max_completion_tokens": 10**7}, "max_completion_tokens must be <="),
        ("/v1/chat/completions", {"max_tokens": 2, "min_tokens": 5}, "min_tokens must be <= max_tokens"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 10**7}, "max_output_tokens must be <="),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "content is required in a user message"),
    ],
)  # fmt: skip
def test_openai_refusals_name_the_fields_the_client_sent(server, path, body, fragment):
    if path == "/v1/chat/completions" and "messages" not in body:
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    for stream in (False, True):
        resp = httpx.post(f"{server}{path}", json={"model": "tiny", "stream": stream, **body})
        assert resp.status_code == 400, resp.text
        assert fragment in resp.json()["error"]["message"]


def test_bad_bodies_and_the_server_keeps_serving(server, client):
    assert (
        httpx.post(
            f"{server}/generate", content=b"{not json", headers={"content-type": "application/json"}
        ).status_code
        == 400
    )
    assert httpx.post(f"{server}/generate", content=b"[1, 2]").status_code == 400
    assert (
        httpx.post(
            f"{server}/v1/chat/completions", json={"model": "tiny", "messages": []}
        ).status_code
        == 400
    )
    big = b"x" * (64 * 2**20 + 10)
    assert httpx.post(f"{server}/generate", content=big).status_code == 413
    assert (
        client.generate("still alive?", {"max_new_tokens": 2})["meta_info"]["completion_tokens"]
        == 2
    )


def test_sglang_clients_get_routes_and_server_args_fields(server):
    # slime calls GET /flush_cache before each update and GET /get_weights_by_name to check one.
    assert httpx.get(f"{server}/flush_cache").json()["success"] is True
    name = "model.layers.0.mlp.down_proj.weight"
    by_get = httpx.get(f"{server}/get_weights_by_name", params={"name": name, "truncate_size": 2})
    by_post = httpx.post(f"{server}/get_weights_by_name", json={"name": name, "truncate_size": 2})
    assert by_get.status_code == 200 and by_get.json() == by_post.json() and len(by_get.json()) == 2
    info = httpx.get(f"{server}/server_info").json()
    again = httpx.get(f"{server}/get_server_info").json()
    assert info.keys() == again.keys() and info["model_path"] == again["model_path"]
    assert (info["tp_size"], info["dp_size"]) == (1, 1)
    assert info["max_total_num_tokens"] == info["max_total_tokens"] and info["version"]


def test_fields_sglang_clients_always_send_are_accepted(server):
    # AReaL sends image_data: null with every request; slime sends sampling_seed and the rest.
    body = {
        "input_ids": [5, 6, 7],
        "image_data": None,
        "lora_path": None,
        "return_routed_experts": False,
        "pp_rank": 0,
        "custom_logit_processor": None,
        "log_metrics": False,
        "sampling_params": {
            "max_new_tokens": 4,
            "temperature": 1.0,
            "sampling_seed": 3,
            "custom_params": None,
        },
    }
    first = httpx.post(f"{server}/generate", json=body)
    assert first.status_code == 200, first.text
    again = httpx.post(
        f"{server}/generate",
        json={
            **body,
            "sampling_params": {**body["sampling_params"], "sampling_seed": None, "seed": 3},
        },
    )
    assert first.json()["output_ids"] == again.json()["output_ids"]  # sampling_seed is the seed
    for field, value in (
        ("image_data", "a.png"),
        ("lora_path", "adapter"),
        ("return_routed_experts", True),
        ("pp_rank", 1),
    ):
        resp = httpx.post(f"{server}/generate", json={**body, field: value})
        assert resp.status_code == 400 and field in resp.json()["error"]["message"]
