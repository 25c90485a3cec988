"""The OpenAI routes' bodies as OpenAI checks them, against the app in process (a stand-in engine
that records what reached it): no type is converted ("2" is no int, "yes" no bool), max_tokens
is >= 1 (0 on /v1/completions only with echo, to score the prompt), top_logprobs needs logprobs;
and GET /v1/models/{id} serves ids that are filesystem paths."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from rollout.config import RequestOptions
from rollout.engine.request_limits import RequestLimits
from rollout.server.app import create_app
from rollout.server.json_body import LARGE_BODY_BYTES
from rollout.server.options import ServerOptions

MODEL = "/checkpoints/org/tiny-qwen3"  # the served model's id: its path
MESSAGES = [{"role": "user", "content": "hi"}]
BASE = {"/v1/completions": {"prompt": "hi"}, "/v1/chat/completions": {"messages": MESSAGES}}


class _RecordingEngine:
    """Answers every request with "ok", and keeps the sampling params each one reached it with."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.limits = RequestLimits(4096, RequestOptions())
        self.info = {"context_length": 4096}
        self.options = SimpleNamespace(
            model=SimpleNamespace(model_path=MODEL, is_embedding=False),
            lora=SimpleNamespace(enable_lora=True),
        )
        self.calls: list[dict] = []

    def is_alive(self) -> bool:
        return True

    def get_server_info(self) -> dict:
        return {"lora_adapters": {"sql": "/adapters/sql"}}

    async def run_in_worker(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def validate_generate(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def async_generate(self, *args: Any, stream: bool = False, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        meta = {"id": "r", "finish_reason": {"type": "length"}, "prompt_tokens": 1,
                "completion_tokens": 0, "cached_tokens": 0, "weight_version": "v0"}  # fmt: skip
        out = {"text": "", "output_ids": [], "meta_info": meta}
        if not stream:
            return [out] * kwargs["sampling_params"]["n"]

        async def chunks():
            yield out

        return chunks()


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    return _RecordingEngine(AutoTokenizer.from_pretrained(tiny_qwen3))


@pytest.fixture(scope="module")
def http(engine):
    with TestClient(create_app(engine, ServerOptions())) as client:
        yield client


def _post(http: TestClient, path: str, **fields: Any) -> Any:
    return http.post(path, json={"model": MODEL, **BASE[path], **fields})


def _refused(resp: Any, fragment: str) -> None:
    assert resp.status_code == 400, resp.text
    assert fragment in resp.json()["error"]["message"]


COMMON_BAD = [
    ("n", "2"),
    ("n", True),
    ("stream", "yes"),
    ("stream", 1),
    ("max_tokens", "5"),
    ("max_tokens", 5.0),
    ("temperature", "0.5"),
    ("temperature", True),
    ("top_p", "1"),
    ("seed", "7"),
    ("top_k", "5"),
    ("min_tokens", "1"),
    ("ignore_eos", "true"),
    ("skip_special_tokens", 0),
    ("stop_token_ids", ["5"]),
    ("logit_bias", {"5": "1"}),
    ("stream_options", {"include_usage": "yes"}),
]
COMPLETIONS_BAD = [("logprobs", "true"), ("logprobs", True), ("logprobs", "2"), ("echo", "true")]
CHAT_BAD = [
    ("logprobs", "true"),
    ("logprobs", 1),
    ("max_completion_tokens", "5"),
    ("parallel_tool_calls", "false"),
    ("continue_final_message", "no"),
    ("messages", [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
]


@pytest.mark.parametrize(
    "path, field, value",
    [("/v1/completions", f, v) for f, v in COMMON_BAD + COMPLETIONS_BAD]
    + [("/v1/chat/completions", f, v) for f, v in COMMON_BAD + CHAT_BAD],
)
def test_a_field_of_the_wrong_type_is_a_400_naming_it(http, path, field, value):
    _refused(_post(http, path, **{field: value}), f"invalid request: {field}")


def test_a_large_body_is_checked_as_strictly(http):
    """Over LARGE_BODY_BYTES the body is validated off the event loop (json_body): same model."""
    ids = [7] * (LARGE_BODY_BYTES // 3 + 1)  # "7, " each
    _refused(_post(http, "/v1/completions", prompt=ids, n="2"), "invalid request: n:")


@pytest.mark.parametrize(
    "path, fields, message",
    [
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ("/v1/chat/completions", {"max_tokens": -1}, "max_tokens must be >= 1, got -1"),
        ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens must be >= 1, got 0"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens must be >= 1 (0 only with echo), got 0"),
        ("/v1/completions", {"max_tokens": -3}, "max_tokens must be >= 1 (0 only with echo), got -3"),
        ("/v1/completions", {"max_tokens": -1, "echo": True}, "max_tokens must be >= 0, got -1"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs (2) needs logprobs: true"),
        ("/v1/chat/completions", {"top_logprobs": 2, "logprobs": False}, "top_logprobs (2) needs logprobs: true"),
    ],
)  # fmt: skip
def test_out_of_range_limits_are_refused_naming_the_field(http, engine, path, fields, message):
    for stream in (False, True):
        before = len(engine.calls)
        _refused(_post(http, path, stream=stream, **fields), message)
        assert len(engine.calls) == before


@pytest.mark.parametrize(
    "path, fields, sent",
    [
        # An int where a float is expected is a float.
        ("/v1/completions", {"temperature": 1, "top_p": 1}, {"temperature": 1.0, "top_p": 1.0}),
        ("/v1/chat/completions", {"temperature": 1, "top_k": 2}, {"temperature": 1.0, "top_k": 2}),
        # Scoring the prompt: its logprobs, nothing generated (as vLLM allows).
        ("/v1/completions", {"max_tokens": 0, "echo": True}, {"max_new_tokens": 0}),
        ("/v1/chat/completions", {"max_completion_tokens": 1}, {"max_new_tokens": 1}),
        ("/v1/chat/completions", {"top_logprobs": 0}, {}),  # asks for nothing: no logprobs
    ],
)
def test_well_typed_bodies_reach_the_engine(http, engine, path, fields, sent):
    for stream in (False, True):
        resp = _post(http, path, stream=stream, **fields)
        assert resp.status_code == 200, resp.text
        params = engine.calls[-1]["sampling_params"]
        assert {k: params[k] for k in sent} == sent
        assert engine.calls[-1]["return_logprob"] is False


def test_top_logprobs_with_logprobs_reach_the_engine(http, engine):
    resp = _post(http, "/v1/chat/completions", logprobs=True, top_logprobs=3)
    assert resp.status_code == 200, resp.text
    assert engine.calls[-1]["return_logprob"] is True
    assert engine.calls[-1]["top_logprobs_num"] == 3


def test_a_model_whose_id_is_a_path_is_retrieved_with_its_adapters(http):
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
    assert [m.id for m in oai.models.list().data] == [MODEL, f"{MODEL}:sql"]
    assert oai.models.retrieve(MODEL).id == MODEL
    for url in (f"/v1/models/{MODEL}", f"/v1/models/{MODEL.replace('/', '%2F')}"):
        assert http.get(url).json()["id"] == MODEL
    adapter = http.get(f"/v1/models/{MODEL}:sql").json()
    assert adapter["id"] == f"{MODEL}:sql" and adapter["parent"] == MODEL


@pytest.mark.parametrize("model", ["/checkpoints/org/other", "org/tiny-qwen3", f"{MODEL}:nope"])
def test_an_unknown_model_is_a_404_naming_it(http, model):
    resp = http.get(f"/v1/models/{model}")
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error["type"] == "model_not_found" and error["code"] == 404
    assert repr(model) in error["message"]
