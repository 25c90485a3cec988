"""Constrained outputs over HTTP, through the official `openai` client against `rollout serve`:
response_format json_schema / json_object, tool_choice "required" and a named function (the
calls come back parsed, whole and streamed), SGLang's regex on /generate and /v1/completions,
and a bad grammar or tool_choice is a 400 naming the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_helpers import start_server, stop_server

pytest.importorskip("xgrammar")

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "add", "parameters": SCHEMA}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    proc, url = start_server(
        tiny_qwen2, "--served-model-name", MODEL, "--tool-call-parser", "qwen25"
    )
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_response_format_json_schema_validates(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=response_format, n=8, seed=0,
        temperature=1.0, max_tokens=48,
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_json_object_parses(client):
    # Any object: its strings are unbounded, so only some samples end (after this prompt, most).
    messages = [{"role": "user", "content": "Hello there"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, response_format={"type": "json_object"}, n=16, seed=3,
        temperature=1.0, max_tokens=32,
    )  # fmt: skip
    ended = [c for c in out.choices if c.finish_reason == "stop"]
    assert ended
    for choice in ended:
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("parallel", [False, True])
def test_tool_choice_required_yields_parsed_calls(client, parallel):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=4, seed=1,
        temperature=1.0, max_tokens=160, parallel_tool_calls=parallel,
    )  # fmt: skip
    for choice in out.choices:
        # In parallel, the (random) model may go on calling past max_tokens: the calls it
        # finished are still calls.
        assert choice.finish_reason == "tool_calls" or parallel
        assert choice.message.tool_calls
        assert len(choice.message.tool_calls) == 1 or parallel
        if choice.finish_reason == "tool_calls":
            assert not choice.message.content
        for call in choice.message.tool_calls:
            tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_tool_choice_calls_that_function_once(client):
    choice_of = {"type": "function", "function": {"name": "add"}}
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice_of, n=4, seed=2,
        temperature=1.0, max_tokens=100,
    )  # fmt: skip
    for choice in out.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "add" and choice.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_streamed_required_tool_calls_add_up(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=4,
        temperature=1.0, max_tokens=200, stream=True, parallel_tool_calls=False,
    )  # fmt: skip
    calls, reasons = {}, []
    for chunk in stream:
        for c in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
            entry["name"] += (c.function.name or "") if c.function else ""
            entry["arguments"] += (c.function.arguments or "") if c.function else ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and list(calls) == [0]
    tool = next(t for t in TOOLS if t["function"]["name"] == calls[0]["name"])
    jsonschema.validate(json.loads(calls[0]["arguments"]), tool["function"]["parameters"])


def test_regex_on_generate_and_completions(server, client):
    pattern = r"[a-z]{2,5}-[0-9]{2}"
    body = {"text": "Hello", "sampling_params": {"regex": pattern, "temperature": 1.0,
                                                 "max_new_tokens": 32, "n": 4, "seed": 0}}  # fmt: skip
    outs = httpx.post(f"{server}/generate", json=body, timeout=120).json()
    assert len(outs) == 4 and all(re.fullmatch(pattern, o["text"]) for o in outs)
    done = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=32, temperature=1.0, seed=1,
        extra_body={"regex": pattern},
    )  # fmt: skip
    assert re.fullmatch(pattern, done.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format is not a valid JSON schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"regex": "[a-"}, "regex"),
        ({"json_schema": "{not json"}, "json_schema must be valid JSON"),
        ({"ebnf": "root ::= foo"}, "ebnf is not a valid EBNF grammar"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
          "tool_choice": "required"}, r"tools\[0\].function.parameters is not a usable JSON schema"),
    ],
)  # fmt: skip
def test_bad_grammar_requests_are_400(client, extra, match):
    extra = dict(extra)
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8,
            tools=extra.pop("tools", openai.NOT_GIVEN),
            tool_choice=extra.pop("tool_choice", openai.NOT_GIVEN),
            response_format=extra.pop("response_format", openai.NOT_GIVEN),
            extra_body=extra or None,
        )  # fmt: skip
