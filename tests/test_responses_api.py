"""/v1/responses through the official `openai` client: text, reasoning and function calls as
output items, whole and streamed; previous_response_id continues a stored conversation;
bad input is a clear 400. Tool calls use a scripted engine (the tiny model's output is random);
plain text runs on the tiny model behind `rollout serve`. Harmony (gpt-oss) rendering and
parsing run where openai-harmony and its vocabulary are at hand."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.resources
import itertools
import json
import os
import struct
import sys
import time
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from rollout.config import RequestOptions
from rollout.engine.request_limits import RequestLimits
from rollout.errors import InvalidRequest
from rollout.server import harmony
from rollout.server.app import create_app
from rollout.server.json_body import LARGE_BODY_BYTES
from rollout.server.options import ServerOptions
from rollout.server.responses_store import ResponseStore, stored
from tests.server_helpers import start_server, stop_server

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
OUTPUT = (
    "<think>The user wants the weather.</think>Let me check. "
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)


class _ScriptedEngine:
    """Answers every request with `output` (text, or ids for Harmony), streamed in pieces;
    keeps the prompt ids it was given."""

    def __init__(self, tokenizer: Any, output: str | list[int] = OUTPUT) -> None:
        self.tokenizer, self.output = tokenizer, output
        self.limits = RequestLimits(4096, RequestOptions())
        self.info = {"context_length": 4096}
        self.options = SimpleNamespace(model=SimpleNamespace(model_path="m", is_embedding=False))
        self.prompts: list[list[int]] = []
        self.fail_at: int | None = None  # a streamed answer fails after this many characters

    def is_alive(self) -> bool:
        return True

    async def run_in_worker(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def validate_generate(self, *args: Any, **kwargs: Any) -> None:
        pass

    def _out(self, end: int, done: bool) -> dict:
        reason = {"type": "stop", "matched": None} if done else None
        meta = {"id": "r", "finish_reason": reason, "prompt_tokens": 3, "completion_tokens": end,
                "cached_tokens": 0, "weight_version": "v0"}  # fmt: skip
        if isinstance(self.output, str):
            return {"text": self.output[:end], "output_ids": [], "meta_info": meta}
        return {"text": "", "output_ids": self.output[:end], "meta_info": meta}

    async def async_generate(self, *args: Any, stream: bool = False, **kwargs: Any) -> Any:
        ids = kwargs["input_ids"]
        self.prompts.append(ids[0] if ids and isinstance(ids[0], list) else ids)
        self.params = kwargs["sampling_params"]
        size = len(self.output)
        if not stream:
            return [self._out(size, True)]

        async def chunks():
            for end in range(3, size + 3, 3):
                await asyncio.sleep(0)
                if self.fail_at is not None and end > self.fail_at:
                    raise InvalidRequest("the scripted stream failed")
                yield self._out(min(end, size), end >= size)

        return chunks()


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    return AutoTokenizer.from_pretrained(tiny_qwen3)


def _client(engine: Any, **options: Any) -> openai.OpenAI:
    app = create_app(engine, ServerOptions(**options))
    app.state.model_name = "m"
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=TestClient(app))


def _streamed(events: Any) -> tuple[list[str], Any]:
    """The event types of a stream, and its final response."""
    types, final = [], None
    for event in events:
        types.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    return types, final


def test_reasoning_text_and_function_calls_are_output_items(tokenizer):
    client = _client(
        _ScriptedEngine(tokenizer), tool_call_parser="qwen25", reasoning_parser="qwen3"
    )
    whole = client.responses.create(model="m", input="Weather in Paris?", tools=TOOLS)
    assert whole.status == "completed"
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output[0].content[0].text == "The user wants the weather."
    assert whole.output_text == "Let me check."
    call = whole.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert whole.usage.input_tokens == 3 and whole.usage.output_tokens == len(OUTPUT)

    stream = client.responses.create(model="m", input="Weather in Paris?", tools=TOOLS, stream=True)
    types, final = _streamed(stream)
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    for kind in ("response.reasoning_text.delta", "response.output_text.delta",
                 "response.function_call_arguments.done", "response.output_item.done"):  # fmt: skip
        assert kind in types
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me check."
    assert final.output[2].arguments == call.arguments


def test_streamed_events_add_up_to_the_items(tokenizer):
    client = _client(
        _ScriptedEngine(tokenizer), tool_call_parser="qwen25", reasoning_parser="qwen3"
    )
    text, arguments, numbers = "", "", []
    for event in client.responses.create(model="m", input="hi", tools=TOOLS, stream=True):
        numbers.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.function_call_arguments.delta":
            arguments += event.delta
        elif event.type == "response.output_text.done":
            assert event.text == text
        elif event.type == "response.function_call_arguments.done":
            assert event.arguments == arguments and event.name == "get_weather"
    assert text == "Let me check." and json.loads(arguments) == {"city": "Paris"}
    assert numbers == list(range(len(numbers)))


def test_a_streamed_response_has_one_created_at(tokenizer, monkeypatch):
    """Every event's Response object, and the stored one, however long the stream takes."""
    ticks = itertools.count(1_700_000_000)
    monkeypatch.setattr(time, "time", lambda: float(next(ticks)))  # a second passes per look
    client = _client(_ScriptedEngine(tokenizer))
    created, rid = {}, None
    for event in client.responses.create(model="m", input="hi", stream=True):
        if hasattr(event, "response"):
            created[event.type], rid = event.response.created_at, event.response.id
    assert set(created) == {"response.created", "response.in_progress", "response.completed"}
    created["stored"] = client.responses.retrieve(rid).created_at
    assert len(set(created.values())) == 1, created


TOOL_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<call {{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}{% endfor %}"
    "[assistant]"
)


def test_previous_response_id_continues_the_stored_conversation(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = TOOL_TEMPLATE  # one that shows the history's tool calls
    engine = _ScriptedEngine(tokenizer)
    client = _client(engine, tool_call_parser="qwen25", reasoning_parser="qwen3")
    first = client.responses.create(
        model="m", input="Weather in Paris?", tools=TOOLS, instructions="Be brief."
    )
    call = first.output[2]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}
    second = client.responses.create(
        model="m", input=[answer], tools=TOOLS, previous_response_id=first.id, stream=True
    )
    _, final = _streamed(second)
    prompt = tokenizer.decode(engine.prompts[-1])
    assert "Be brief." not in prompt  # instructions are not carried over
    for seen in ("Weather in Paris?", "Let me check.", '<call get_weather {"city": "Paris"}>',
                 "[tool]sunny, 21C"):  # fmt: skip
        assert seen in prompt, (seen, prompt)
    assert prompt.index("Weather in Paris?") < prompt.index("Let me check.") < prompt.index("sunny")
    assert client.responses.retrieve(final.id).id == final.id  # streamed answers are stored too

    third = client.responses.create(model="m", input="And Rome?", previous_response_id=final.id)
    prompt = tokenizer.decode(engine.prompts[-1])
    assert "sunny, 21C" in prompt and "And Rome?" in prompt and third.status == "completed"

    unstored = client.responses.create(model="m", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(third.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="m", input="more", previous_response_id=third.id)


def test_bad_input_is_a_clear_400(tokenizer):
    client = _client(_ScriptedEngine(tokenizer), tool_call_parser="qwen25")
    bad = {
        "unknown previous": (dict(input="hi", previous_response_id="resp_nope"), "resp_nope"),
        "image part": (
            dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
            "input_image",
        ),
        "item type": (dict(input=[{"type": "item_reference", "id": "x"}]), "item_reference"),
        "hosted tool": (dict(input="hi", tools=[{"type": "web_search"}]), "web_search"),
        "role": (dict(input=[{"role": "robot", "content": "hi"}]), "robot"),
        "call without id": (
            dict(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
            "call_id",
        ),
        "text format": (dict(input="hi", text={"format": {"type": "yaml"}}), "yaml"),
        "no message": (dict(input=[], instructions="Be brief."), "no message"),
        "output type": (
            dict(input=[{"type": "function_call_output", "call_id": "c", "output": 5}]),
            r"input\[0\]\.output must be a string",
        ),
        "required, no tools": (dict(input="hi", tool_choice="required"), "needs at least one tool"),
        "named, no tools": (
            dict(input="hi", tool_choice={"type": "function", "name": "f"}),
            "not among the tools",
        ),
    }
    for name, (kwargs, named) in bad.items():
        with pytest.raises(openai.BadRequestError, match=named):
            client.responses.create(model="m", **kwargs)
        assert name
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.responses.create(model="other", input="hi")
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        _client(_ScriptedEngine(tokenizer)).responses.create(model="m", input="hi", tools=TOOLS)


@pytest.mark.parametrize(
    "field",
    [
        '"metadata": {"k": "v\\ud800"}',
        '"user": "u\\ud800"',
        '"reasoning": {"effort": "\\ud800"}',
        '"text": {"format": {"type": "json_object", "x": "\\ud800"}}',
        '"tools": [{"type": "function", "name": "f", "x": "\\ud800"}]',
    ],
)
@pytest.mark.parametrize("stream", ["false", "true"])
def test_a_field_the_response_repeats_that_no_json_can_hold_is_a_400(tokenizer, field, stream):
    """A lone surrogate (JSON's "\\ud800" without its pair) in a field the Response object
    repeats is refused up front: it could not be written back."""
    app = create_app(_ScriptedEngine(tokenizer), ServerOptions(tool_call_parser="qwen25"))
    app.state.model_name = "m"
    body = f'{{"model": "m", "input": "hi", "stream": {stream}, {field}}}'
    headers = {"content-type": "application/json"}
    answer = TestClient(app).post("/v1/responses", content=body.encode(), headers=headers)
    assert answer.status_code == 400 and "is not valid Unicode" in answer.text, answer.text


def test_a_stream_that_fails_ends_with_an_error_event(tokenizer):
    engine = _ScriptedEngine(tokenizer)
    engine.fail_at = 20
    client = _client(engine, tool_call_parser="qwen25", reasoning_parser="qwen3")
    events = list(client.responses.create(model="m", input="hi", tools=TOOLS, stream=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].message == "the scripted stream failed"
    assert events[-1].response.status == "failed"
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):  # not stored
        client.responses.create(model="m", input="hi", previous_response_id=events[-1].response.id)


def test_the_store_keeps_the_newest_responses_only():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(stored({"id": f"r{i}"}, [{"type": "message", "role": "user"}], "hi"))
    assert store.get("r0") is None and store.get("r2") is not None
    with pytest.raises(InvalidRequest, match="newest 2"):
        store.conversation("r0")
    assert store.conversation("r1") == [{"type": "message", "role": "user"}]

    by_size = ResponseStore(capacity=100, max_chars=120)  # each is 54
    for i in range(3):
        by_size.put(stored({"id": f"r{i}"}, [], "x" * 40))
    assert by_size.get("r0") is None and by_size.get("r1") and by_size.get("r2")
    by_size.put(stored({"id": "big"}, [], "x" * 500))  # the newest is kept whatever its size
    assert by_size.get("big") and by_size.get("r2") is None


def test_plain_text_on_the_tiny_model_through_rollout_serve(tiny_qwen3):
    proc, url = start_server(tiny_qwen3, "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        first = client.responses.create(
            model="tiny", input="Hello there", max_output_tokens=8, temperature=0
        )
        assert first.status in ("completed", "incomplete")
        assert 0 < first.usage.output_tokens <= 8
        if first.status == "incomplete":
            assert first.incomplete_details.reason == "max_output_tokens"
        assert first.output[0].type == "message" and first.output_text
        types, final = _streamed(
            client.responses.create(
                model="tiny", input="Hello there", max_output_tokens=8, temperature=0, stream=True
            )
        )
        assert types[0] == "response.created" and final.output_text == first.output_text
        # The second turn's prompt starts with the first's: the prefix cache finds it.
        second = client.responses.create(
            model="tiny", input="Go on", previous_response_id=first.id, max_output_tokens=4
        )
        assert second.usage.input_tokens > first.usage.input_tokens + 2
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 2
    finally:
        stop_server(proc)


# --- Harmony (gpt-oss) -------------------------------------------------------------------

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
HARMONY_TEMPLATE = "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final{% endfor %}"


def _o200k_from_quicktok(directory: str) -> bool:
    """Writes o200k_base.tiktoken from the copy of the vocabulary that the quicktok-v1 package
    ships (its own binary layout); True if it was there and its hash is o200k_base's."""
    try:
        data = (importlib.resources.files("quicktok") / "data" / "o200k.vocab").read_bytes()
    except (ImportError, FileNotFoundError):
        return False
    (count,), offset, lines = struct.unpack_from("<I", data, 0), 4, []
    for _ in range(count):
        (size,) = struct.unpack_from("<H", data, offset)
        token = data[offset + 2 : offset + 2 + size]
        (rank,) = struct.unpack_from("<I", data, offset + 2 + size)
        offset += 6 + size
        lines.append(f"{base64.b64encode(token).decode()} {rank}\n")
    text = "".join(lines).encode()
    if hashlib.sha256(text).hexdigest() != O200K_SHA256:
        return False
    with open(os.path.join(directory, "o200k_base.tiktoken"), "wb") as f:
        f.write(text)
    return True


@pytest.fixture(scope="module")
def harmony_encoding(tmp_path_factory):
    pytest.importorskip("openai_harmony")
    given = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if not (given and os.path.exists(os.path.join(given, "o200k_base.tiktoken"))):
        directory = str(tmp_path_factory.mktemp("o200k"))
        if not _o200k_from_quicktok(directory):
            pytest.skip("no o200k_base vocabulary here (TIKTOKEN_ENCODINGS_BASE or quicktok-v1)")
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = directory
    harmony.load_encoding.cache_clear()
    try:
        yield harmony.encoding()
    finally:
        harmony.load_encoding.cache_clear()
        if given is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)


HARMONY_OUTPUT = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
    'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)


def _harmony_engine(enc: Any, output: str = HARMONY_OUTPUT) -> _ScriptedEngine:
    tok = SimpleNamespace(chat_template=HARMONY_TEMPLATE)
    return _ScriptedEngine(tok, enc.encode(output, allowed_special="all"))


def test_harmony_renders_the_conversation_and_parses_channels(harmony_encoding):
    enc = harmony_encoding
    engine = _harmony_engine(enc)
    client = _client(engine)
    whole = client.responses.create(
        model="m", input="Weather in Paris?", tools=TOOLS, instructions="Be brief.",
        reasoning={"effort": "low"},
    )  # fmt: skip
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    assert whole.output[0].content[0].text == "Need the weather."
    call = whole.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    prompt = enc.decode_utf8(engine.prompts[-1])
    assert prompt.startswith("<|start|>system<|message|>") and "Reasoning: low" in prompt
    assert "Be brief." in prompt and "type get_weather" in prompt
    assert prompt.endswith("<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant")
    ends = {enc.encode(t, allowed_special="all")[0] for t in ("<|return|>", "<|call|>")}
    assert set(engine.params["stop_token_ids"]) == ends  # a turn ends at a call or an answer

    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    engine.output = enc.encode(
        "<|channel|>final<|message|>It is sunny.<|return|>", allowed_special="all"
    )
    types, final = _streamed(
        client.responses.create(
            model="m", input=[answer], tools=TOOLS, previous_response_id=whole.id, stream=True
        )
    )
    assert "response.output_text.delta" in types and final.output_text == "It is sunny."
    prompt = enc.decode_utf8(engine.prompts[-1])
    assert "to=functions.get_weather" in prompt and '{"city": "Paris"}<|call|>' in prompt
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny" in (
        prompt
    )


def test_harmony_output_off_format_comes_back_as_text(harmony_encoding):
    client = _client(_harmony_engine(harmony_encoding, "<|channel|>final<|message|>ok<|start|>x"))
    out = client.responses.create(model="m", input="hi")
    assert out.status == "completed" and out.output_text.startswith("ok")
    # No header at all: the parser never reaches a message; the text is not dropped.
    client = _client(_harmony_engine(harmony_encoding, "hello world"))
    assert client.responses.create(model="m", input="hi").output_text == "hello world"


def test_harmony_without_the_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai_harmony", None)  # import fails
    harmony.load_encoding.cache_clear()
    try:
        client = _client(_ScriptedEngine(SimpleNamespace(chat_template=HARMONY_TEMPLATE), [1]))
        with pytest.raises(openai.APIStatusError, match=r"rollout\[harmony\]") as caught:
            client.responses.create(model="m", input="hi")
        assert caught.value.status_code == 501
    finally:
        harmony.load_encoding.cache_clear()


def test_harmony_without_its_vocabulary_is_a_clear_error(monkeypatch, tmp_path):
    pytest.importorskip("openai_harmony")
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))  # no o200k_base.tiktoken there
    harmony.load_encoding.cache_clear()
    try:
        client = _client(_ScriptedEngine(SimpleNamespace(chat_template=HARMONY_TEMPLATE), [1]))
        with pytest.raises(openai.APIStatusError, match="TIKTOKEN_ENCODINGS_BASE") as caught:
            client.responses.create(model="m", input="hi")
        assert caught.value.status_code == 501
    finally:
        harmony.load_encoding.cache_clear()


def test_a_large_body_is_stored_whole_after_its_answer(tokenizer):
    """Large bodies are parsed off the loop and emptied after the answer (json_release); what
    the store keeps of them must survive that."""
    engine = _ScriptedEngine(tokenizer)
    app = create_app(engine, ServerOptions())
    app.state.model_name = "m"
    thought = "x" * (2 * LARGE_BODY_BYTES)  # a reasoning item: not shown to the chat template
    items = [
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": thought}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
    ]  # fmt: skip
    with TestClient(app) as http:
        first = http.post("/v1/responses", json={"model": "m", "input": items})
        assert first.status_code == 200, first.text[:300]
        rid = first.json()["id"]
        kept = app.state.responses.get(rid).conversation
        assert kept[0]["content"][0]["text"] == thought and kept[1]["content"][0]["text"] == "Hi"
        second = http.post(
            "/v1/responses", json={"model": "m", "input": "More", "previous_response_id": rid}
        )
        assert second.status_code == 200, second.text[:300]
    prompt = tokenizer.decode(engine.prompts[-1])
    assert prompt.index("Hi") < prompt.index("More")
