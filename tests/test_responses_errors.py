"""/v1/responses refuses bad input naming the fields a Responses client sent (input,
text.format, tools[i].parameters, max_output_tokens), not the chat API's that serve it
(messages, response_format, structural_tag). The engine here refuses what the real one would
(the sampling params, grammars and limits of build_inputs) and otherwise answers as scripted."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from rollout.engine.request_validation import build_inputs
from rollout.generate_request import GenerateRequest
from rollout.server.app import create_app
from rollout.server.options import ServerOptions
from tests.test_responses_api import HARMONY_TEMPLATE, _ScriptedEngine, harmony_encoding  # noqa: F401

CHAT_NAMES = ("messages", "response_format", "structural_tag", "max_tokens", "max_new_tokens")
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


class _CheckingEngine(_ScriptedEngine):
    def validate_generate(self, *args: Any, **kwargs: Any) -> None:
        request = GenerateRequest.of(*args, **{**kwargs, "stream": False})
        build_inputs(self.tokenizer, self.limits, request)

    async def async_generate(self, *args: Any, stream: bool = False, **kwargs: Any) -> Any:
        self.validate_generate(*args, **kwargs)
        return await super().async_generate(*args, stream=stream, **kwargs)


@pytest.fixture(scope="module")
def http(tiny_qwen3):
    """A server with both parsers: a reasoning parser moves the format's grammar after the
    reasoning (a structural tag), the chat route's other way to refuse it."""
    engine = _CheckingEngine(AutoTokenizer.from_pretrained(tiny_qwen3), "hello")
    options = ServerOptions(tool_call_parser="qwen25", reasoning_parser="qwen3")
    app = create_app(engine, options)
    app.state.model_name = "m"
    with TestClient(app) as client:
        yield client


def _refusal(http: TestClient, body: str, stream: bool) -> str:
    """The message of the 400 that `body` (JSON text, without "model") gets."""
    body = f'{{"model": "m", "stream": {json.dumps(stream)}, {body}}}'
    headers = {"content-type": "application/json"}
    answer = http.post("/v1/responses", content=body.encode(), headers=headers)
    assert answer.status_code == 400, answer.text[:300]
    message = answer.json()["error"]["message"]
    for name in CHAT_NAMES:
        assert name not in message, message
    return message


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("body", "named"),
    [
        ('"input": "hi \\ud800"', "input is"),
        ('"input": [{"role": "user", "content": "\\ud800"}]', "input[0].content is"),
        (
            '"input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, '
            '{"role": "user", "content": [{"type": "input_text", "text": "x\\ud800"}]}]',
            "input[2].content[0].text is",
        ),
        (
            '"input": [{"type": "function_call_output", "call_id": "c", "output": "\\udfff"}]',
            "input[0].output is",
        ),
    ],
    ids=["string", "message", "part", "call output"],
)
def test_a_lone_surrogate_in_the_input_is_named_where_it_is(http, body, named, stream):
    message = _refusal(http, body, stream)
    assert message.startswith(named) and "not valid Unicode" in message, message


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("text", "named"),
    [
        ({"type": "json_schema", "name": "x", "schema": {"type": "nope"}}, "text.format.schema"),
        ({"type": "json_schema", "name": "x", "schema": False}, "text.format.schema"),
        ({"type": "json_schema", "name": "x"}, "text.format.schema"),
        ({"type": "json_schema", "name": "x", "schema": "object"}, "text.format.schema"),
    ],
    ids=["bad type", "false", "no schema", "a string"],
)
def test_a_bad_text_format_is_named_text_format(http, text, named, stream):
    message = _refusal(http, f'"input": "hi", "text": {json.dumps({"format": text})}', stream)
    assert message.startswith(named), message


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "text.format 'json_object'",
        ),
        ({"tools": [{**WEATHER, "parameters": "object"}]}, "tools[0].parameters must be"),
        ({"input": "x" * 100_000}, "the input (with the instructions and earlier turns) has"),
        ({"max_output_tokens": 10**6}, "max_output_tokens must be <="),
    ],
    ids=["format and forced call", "tool parameters", "too long", "max_output_tokens"],
)
def test_other_refusals_name_the_responses_fields(http, body, named):
    message = _refusal(http, json.dumps({"input": "hi", **body})[1:-1], stream=False)
    assert named in message, message


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", "0.5"), ("stream", "yes"), ("max_output_tokens", "5"), ("store", 1),
     ("top_k", 2.0), ("parallel_tool_calls", "false")],
)  # fmt: skip
def test_a_value_of_the_wrong_type_is_refused_not_converted(http, field, value):
    body = {"model": "m", "input": "hi", field: value}
    answer = http.post("/v1/responses", json=body)
    assert answer.status_code == 400, answer.text[:300]
    assert field in answer.json()["error"]["message"]


def test_a_good_text_format_is_served(http):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        "model": "m",
        "input": "hi",
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
    }
    answer = http.post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.text[:300]
    assert answer.json()["output"][0]["content"][0]["text"] == "hello"


@pytest.mark.usefixtures("harmony_encoding")
def test_a_harmony_models_refusal_names_max_output_tokens():
    engine = _CheckingEngine(SimpleNamespace(chat_template=HARMONY_TEMPLATE), [1, 2])
    app = create_app(engine, ServerOptions())
    app.state.model_name = "m"
    with TestClient(app) as client:
        for stream in (False, True):
            body = {"model": "m", "input": "hi", "max_output_tokens": 10**6, "stream": stream}
            answer = client.post("/v1/responses", json=body)
            assert answer.status_code == 400, answer.text[:300]
            assert "max_output_tokens must be <=" in answer.json()["error"]["message"]
