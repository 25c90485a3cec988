"""Bounds on one request (issue 18, item 3 and part of 5): prompt size, n, top_logprobs_num, the
response's logprob entries, max_new_tokens against the context, lone surrogates, callers' chat
templates; each a 400 over HTTP and a ValueError from RolloutEngine that names the bound. And
/health keeps answering while one huge prompt is read, checked and tokenized."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from server_helpers import health_latencies_while, start_server, stop_server
from transformers import AutoTokenizer

from rollout import RolloutEngine
from rollout.config import RequestOptions
from rollout.engine.chat_template import chat_ids
from rollout.engine.request_limits import RequestLimits

CONTEXT = 1024  # short: prompts that fill it prefill fast on a CPU
BYTES_PER_TOKEN = 2048  # so that a 2 MB prompt passes the size bound and must be tokenized
HEALTH_BOUND_S = 0.3  # the target is 0.1 s; CI's two slow cores get a margin


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    proc, url = start_server(
        tiny_qwen3,
        *("--context-length", str(CONTEXT), "--max-bytes-per-token", str(BYTES_PER_TOKEN)),
        *("--max-request-bytes", str(64 * 2**20)),
    )
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    opts = dict(device="cpu", dtype="float32", max_total_tokens=8192, context_length=CONTEXT)
    with RolloutEngine(tiny_qwen3, max_bytes_per_token=BYTES_PER_TOKEN, **opts) as e:
        yield e


def _post(url: str, path: str, body: dict | str) -> httpx.Response:
    # A str body goes out as is: json.dumps escapes a lone surrogate as "\ud800", which is
    # how a client sends one.
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    return httpx.post(url + path, content=content, headers=headers, timeout=120)


def _error_400(resp: httpx.Response) -> str:
    assert resp.status_code == 400, resp.text[:500]
    return resp.json()["error"]["message"]


# (engine.generate kwargs, what the message must name). /generate takes the same fields, with
# `text` for `prompt`.
LIMIT_CASES = {
    "prompt size": (
        {"prompt": "x" * (CONTEXT * BYTES_PER_TOKEN + 1)},
        f"has {CONTEXT * BYTES_PER_TOKEN + 1} bytes of UTF-8 text, over the limit of "
        f"{CONTEXT * BYTES_PER_TOKEN} (context_length {CONTEXT} x max_bytes_per_token "
        f"{BYTES_PER_TOKEN})",
    ),
    # In bytes, not characters: a tokenizer may make a token of each byte of an emoji.
    "prompt size in bytes": (
        {"prompt": "\U0001f600" * (CONTEXT * BYTES_PER_TOKEN // 4 + 1)},
        f"has {4 * (CONTEXT * BYTES_PER_TOKEN // 4 + 1)} bytes of UTF-8 text, over the limit",
    ),
    "n": ({"prompt": "Hi", "sampling_params": {"n": 1025}}, "n must be <= 1024 (option max_n)"),
    # The request (with 4000 prompt tokens) built a 421 MB response in 53 s.
    "top_logprobs_num": (
        {
            "input_ids": [5] * 1000,
            "sampling_params": {"n": 4},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 1000,
        },
        "top_logprobs_num must be <= 256 (option max_top_logprobs_num), got 1000",
    ),
    # 32 samples x (1000 prompt + 24 new positions) x 256 = 8.4M entries: hundreds of MB.
    "logprob entries": (
        {
            "input_ids": [5] * 1000,
            "sampling_params": {"n": 32},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 256,
        },
        "(option max_logprob_entries)",
    ),
    "max_new_tokens": (
        {"prompt": "Hi", "sampling_params": {"max_new_tokens": 10**12}},
        f"max_new_tokens must be <= the context length {CONTEXT}, got 1000000000000",
    ),
    "surrogate in prompt": (
        {"prompt": "ab\ud800cd"},
        "the prompt is not valid Unicode: lone surrogate U+D800 at position 2",
    ),
    "surrogate in stop": (
        {"prompt": "Hi", "sampling_params": {"stop": ["ok", "x\udc00"]}},
        "a stop string is not valid Unicode: lone surrogate U+DC00 at position 1",
    ),
}


@pytest.mark.parametrize("case", list(LIMIT_CASES))
def test_each_limit_is_a_400_and_a_value_error_naming_it(case, server, engine):
    kwargs, expected = LIMIT_CASES[case]
    body = {("text" if k == "prompt" else k): v for k, v in kwargs.items()}
    assert expected in _error_400(_post(server, "/generate", body))
    with pytest.raises(ValueError) as err:
        engine.generate(**kwargs)
    assert expected in str(err.value)


def test_openai_routes_check_the_same_limits(server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    model = httpx.get(server + "/v1/models").json()["data"][0]["id"]
    chat["model"] = model
    # Streamed choices run as one stream each: n is still bounded over all of them.
    message = _error_400(_post(server, "/v1/chat/completions", {**chat, "n": 2000, "stream": True}))
    assert "(option max_n)" in message
    bad_content = {**chat, "messages": [{"role": "user", "content": "a\ud800"}]}
    assert "lone surrogate U+D800" in _error_400(_post(server, "/v1/chat/completions", bad_content))
    completion = {"model": model, "prompt": ["fine", "b\udbff"], "max_tokens": 2}
    message = _error_400(_post(server, "/v1/completions", completion))
    assert "prompt 1 is not valid Unicode: lone surrogate U+DBFF at position 1" in message
    message = _error_400(
        _post(server, "/v1/completions", {**completion, "prompt": "x", "max_tokens": 10**9})
    )
    assert "max_tokens must be <= the context length" in message  # the client's name of it


def test_chat_template_kwargs_take_template_variables_only(server):
    model = httpx.get(server + "/v1/models").json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    ok = _post(
        server, "/v1/chat/completions", {**chat, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert ok.status_code == 200, ok.text
    template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    user_template = {**chat, "chat_template_kwargs": {"chat_template": template}}
    assert "allow_user_chat_template" in _error_400(
        _post(server, "/v1/chat/completions", user_template)
    )
    for key, value in (
        ("tokenize", True),
        ("return_tensors", "pt"),
        ("add_generation_prompt", False),
    ):
        body = {**chat, "chat_template_kwargs": {key: value}}
        message = _error_400(_post(server, "/v1/chat/completions", body))
        assert f"template variables only, not {key}" in message


def test_a_callers_template_renders_only_when_allowed_and_under_a_deadline(tiny_qwen3):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    messages = [{"role": "user", "content": "Hi"}]
    allowed = RequestLimits(
        4096, RequestOptions(allow_user_chat_template=True, chat_template_timeout_s=0.3)
    )
    own = {"chat_template": "{{ messages[0]['content'] }}!"}
    assert chat_ids(tokenizer, allowed, messages, True, template_kwargs=own) == tokenizer.encode(
        "Hi!", add_special_tokens=False
    )
    with pytest.raises(ValueError, match="allow_user_chat_template"):
        chat_ids(
            tokenizer, RequestLimits(4096, RequestOptions()), messages, True, template_kwargs=own
        )
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ValueError, match="longer than 0.3 s to render"):
        chat_ids(tokenizer, allowed, messages, True, template_kwargs={"chat_template": endless})
    assert time.monotonic() - start < 3  # 10^10 iterations unbounded


def test_a_capped_max_new_tokens_is_reported_in_meta_info(engine, server):
    context = engine.info["context_length"]
    prompt = [5] * (context - 6)
    params = {"max_new_tokens": 100, "ignore_eos": True, "temperature": 0}
    out = engine.generate(input_ids=prompt, sampling_params=params)
    assert out["meta_info"]["max_new_tokens_capped"] == 6
    assert out["meta_info"]["completion_tokens"] == 6
    over_http = _post(server, "/generate", {"input_ids": prompt, "sampling_params": params}).json()
    assert over_http["meta_info"]["max_new_tokens_capped"] == 6
    free = engine.generate(input_ids=[5] * 10, sampling_params={**params, "max_new_tokens": 3})
    assert "max_new_tokens_capped" not in free["meta_info"]




def test_health_answers_while_a_huge_prompt_is_tokenized(server):
    # ~2 M characters: under the size bound, so the server tokenizes it (a second or two) and
    # then finds it too long for the context. The tokenizing runs on a worker thread.
    text = "hello world " * 170_000
    resp, latencies = health_latencies_while(server, json.dumps({"text": text}).encode())
    assert "leaves no room in the context" in _error_400(resp)
    assert len(latencies) >= 5, "the prompt was answered too fast to check /health against it"
    assert max(latencies) < HEALTH_BOUND_S, f"/health took {max(latencies):.3f} s"


def test_health_answers_while_a_prompt_beyond_the_bound_is_refused(server):
    # 20 MB: refused on its size alone, without tokenizing (which took 69 s for 50 MB).
    text = "x" * (20 * 2**20)
    resp, latencies = health_latencies_while(server, json.dumps({"text": text}).encode())
    assert "refused without tokenizing" in _error_400(resp)
    assert max(latencies, default=0) < HEALTH_BOUND_S, f"/health took {max(latencies):.3f} s"
