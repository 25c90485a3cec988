"""Chat completions with --tool-call-parser and --reasoning-parser, through the official
`openai` client: tool calls and reasoning come back as OpenAI fields, whole and streamed, and
the history's tool calls and the request's tools reach the chat template."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from rollout.config import RequestOptions
from rollout.engine.chat_template import chat_ids
from rollout.engine.request_limits import RequestLimits
from rollout.server.app import create_app
from rollout.server.options import ServerOptions

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]
OUTPUT = (
    "<think>The user wants the weather.</think>Let me check. "
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)


class _ScriptedEngine:
    """Answers every chat with OUTPUT, streamed a few characters at a time."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.limits = RequestLimits(4096, RequestOptions())
        self.info = {"context_length": 4096}
        self.options = SimpleNamespace(model=SimpleNamespace(model_path="m", is_embedding=False))

    def is_alive(self) -> bool:
        return True

    async def run_in_worker(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def validate_generate(self, *args: Any, **kwargs: Any) -> None:
        pass

    def _out(self, text: str, done: bool) -> dict:
        reason = {"type": "stop", "matched": None} if done else None
        meta = {"id": "r", "finish_reason": reason, "prompt_tokens": 3, "completion_tokens": len(text),
                "cached_tokens": 0, "weight_version": "v0"}  # fmt: skip
        return {"text": text, "output_ids": [], "meta_info": meta}

    async def async_generate(self, *args: Any, stream: bool = False, **kwargs: Any) -> Any:
        if not stream:
            return [self._out(OUTPUT, True)]

        async def chunks():
            for end in range(7, len(OUTPUT) + 7, 7):
                await asyncio.sleep(0)
                yield self._out(OUTPUT[:end], end >= len(OUTPUT))

        return chunks()


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    return AutoTokenizer.from_pretrained(tiny_qwen3)


def _client(tokenizer: Any, **options: Any) -> openai.OpenAI:
    app = create_app(_ScriptedEngine(tokenizer), ServerOptions(**options))
    app.state.model_name = "m"
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=TestClient(app))


def test_tool_calls_and_reasoning_come_back_as_openai_fields(tokenizer):
    client = _client(tokenizer, tool_call_parser="qwen25", reasoning_parser="qwen3")
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    whole = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.reasoning_content == "The user wants the weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"
    }

    stream = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True)
    content, reasoning, calls, reasons = "", "", {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for c in delta.tool_calls or ():
            entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
            entry["name"] += (c.function.name or "") if c.function else ""
            entry["arguments"] += (c.function.arguments or "") if c.function else ""
        reasons.append(chunk.choices[0].finish_reason)
    assert (content, reasoning) == ("Let me check.", "The user wants the weather.")
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    assert reasons[-1] == "tool_calls"


def test_without_parsers_or_tools_the_text_is_returned_as_it_is(tokenizer):
    plain = _client(tokenizer).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    assert plain.choices[0].message.content == OUTPUT and plain.choices[0].finish_reason == "stop"
    # Tools on a server started without a parser: a clear 400, not text passed off as no call.
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        _client(tokenizer).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS
        )
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        _client(tokenizer, tool_call_parser="qwen25").chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "not_offered"}},
        )


def test_unknown_parser_names_are_refused_at_start():
    with pytest.raises(ValueError, match="hermes"):
        ServerOptions(tool_call_parser="no-such-format")


def test_tools_and_tool_calls_in_the_history_reach_the_template(tokenizer):
    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = (
        "{{ tools | tojson }}{% for m in messages %}[{{ m.role }}]"
        "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.city }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    from rollout.server.openai_protocol import ChatMessage

    messages = [ChatMessage(**m).as_template_input() for m in history]
    ids = chat_ids(tok, RequestLimits(4096, RequestOptions()), messages, False, tools=TOOLS)
    text = tok.decode(ids)
    assert "get_weather" in text.split("[user]")[0]  # the tools, before the messages
    assert "[assistant]Paris" in text and "[tool]sunny" in text  # arguments as an object


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"tools": [{"type": "function", "function": "abc"}]}, r"tools\[0\].function must be an object"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, r"tools\[0\].function.name"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, r"tools\[0\].function.name"),
        ({"tools": [{"type": "code_interpreter"}]}, r"tools\[0\].type must be 'function'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "f"}}, "tool_choice must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice must be"),
        ({"history_call": {"id": "a", "type": "function", "function": "x"}}, r"tool_calls\[0\].function"),
        ({"history_call": {"id": "a", "type": "function", "function": ["x"]}}, r"tool_calls\[0\].function"),
        ({"history_call": {"function": {"name": "f", "arguments": 5}}}, r"tool_calls\[0\].function.arguments"),
    ],
)
def test_malformed_tools_and_tool_calls_are_a_400_naming_them(tokenizer, extra, field):
    messages = [{"role": "user", "content": "hi"}]
    if "history_call" in extra:
        call = extra.pop("history_call")
        messages += [{"role": "assistant", "tool_calls": [call]}, {"role": "user", "content": "k"}]
    client = _client(tokenizer, tool_call_parser="qwen25")
    with pytest.raises(openai.BadRequestError, match=field):
        client.chat.completions.create(model="m", messages=messages, **extra)


TAG = {"type": "structural_tag", "format": {"type": "regex", "pattern": "(yes|no)"}}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}


@pytest.mark.parametrize(
    "extra, refused",
    [
        ({"structural_tag": TAG}, None),
        ({"structural_tag": json.dumps(TAG)}, None),
        ({"json_schema": "{not json"}, "json_schema must be valid JSON"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
         "response_format is not a valid JSON schema"),
        ({"regex": "(unclosed"}, "regex is not a valid regular expression"),
        ({"ebnf": "root ::= foo"}, "ebnf is not a valid EBNF grammar"),
        ({"tools": [{"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
                    {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
          "tool_choice": "required"}, r"tools\[1\].function.parameters is not a usable JSON schema"),
    ],
)  # fmt: skip
def test_grammars_after_reasoning_are_checked_as_the_client_named_them(tokenizer, extra, refused):
    """With a --reasoning-parser the grammar applies after the reasoning (wrapped in a
    structural tag, checked here before the engine sees it); a refusal still names the field
    the client sent (without one the engine checks it: test_grammar_server.py)."""
    client = _client(tokenizer, tool_call_parser="qwen25", reasoning_parser="qwen3")
    extra = dict(extra)
    kw = {k: extra.pop(k) for k in ("tools", "tool_choice", "response_format") if k in extra}
    create = lambda: client.chat.completions.create(  # noqa: E731
        model="m", messages=[{"role": "user", "content": "hi"}], extra_body=extra or None, **kw
    )
    if refused is None:
        assert create().choices[0].message is not None
    else:
        with pytest.raises(openai.BadRequestError, match=refused):
            create()
