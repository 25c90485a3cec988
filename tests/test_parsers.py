"""Reasoning and tool-call parsers on outputs written as the models write them: whole-text
results, and streams in any chunking adding up to exactly the whole-text result."""

from __future__ import annotations

import json
import random

import pytest

from rollout.parsers import (
    REASONING_FORMATS,
    TOOL_CALL_PARSERS,
    ChatOutputParser,
    ParsedMessage,
    chat_output_parser,
    check_parser_names,
    reasoning_parser,
    tool_call_parser,
)

TOOLS = ["get_weather", "get_time"]
WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"tz": "Europe/Paris"}

# (parser, output, expected content, expected [(name, arguments)])
TOOL_OUTPUTS = [
    (
        "qwen25",
        "I'll look that up.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        "I'll look that up.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "hermes",
        '<tool_call>\n{"arguments": {"city": "Zürich"}, "name": "get_weather"}\n</tool_call>',
        "",
        [("get_weather", {"city": "Zürich"})],
    ),
    (
        "qwen25",  # cut short by a stop string before the closing tag: the call is whole
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n',
        "",
        [("get_time", TIME)],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}; {"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
        "",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "llama3",
        'Let me check.<|python_tag|>{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
        "Let me check.",
        [("get_time", TIME)],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
        "",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}',
        "",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "qwen25",  # braces and a closing bracket inside a JSON string
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}b]{\\"c"}}\n</tool_call>',
        "",
        [("get_weather", {"city": 'a}b]{"c'})],
    ),
]

# Outputs that are not valid calls: each comes back as text, exactly as written.
MALFORMED = [
    (
        "qwen25",
        'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
    ),
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),  # cut short
    ("qwen25", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),  # not offered
    ("qwen25", "<tool_call>\n[1, 2]\n</tool_call> and <tool_call> alone"),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "not json"}</tool_call>'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"'),
    ("llama3", '{"result": 4, "explanation": "two plus two"}'),  # a JSON answer, not a call
    ("llama3", '<|python_tag|>brave_search.call(query="weather in Paris")'),
    ("llama3", "The answer is {x} where x = 4"),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}]'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": 3}]'),
    ("mistral", "[TOOL_CALLS] hello there"),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{oops}"),
    ("mistral", "[TOOL_CALLS]get_weather[ARG"),
]

PLAIN = [
    "The capital of France is Paris.",
    "  Two answers:\n\n1. yes\n2. no\n  ",
    "Use <b>bold</b> or [brackets] or {braces}; done; <tool and [TOOL and <|python",
    "",
]

# (parser, in_reasoning, output, expected reasoning, expected content)
REASONING_OUTPUTS = [
    ("qwen3", None, "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is 4.",
     "The user asks 2+2. That is 4.", "The answer is 4."),
    ("qwen3", True, "Okay, 2+2 is 4.\n</think>\n\nIt is 4.", "Okay, 2+2 is 4.", "It is 4."),
    ("qwen3", None, "Okay, 2+2 is 4.\n</think>\n\nIt is 4.", "Okay, 2+2 is 4.", "It is 4."),
    ("qwen3", False, "It is 4.", "", "It is 4."),
    ("qwen3", None, "  It is 4, no thinking needed.", "", "  It is 4, no thinking needed."),
    ("qwen3", None, "<think>\n\n</think>\n\nIt is 4.", "", "It is 4."),
    ("qwen3", None, "<think>\nStill thinking when max_tokens hit", "Still thinking when max_tokens hit", ""),
    ("qwen3-thinking", None, "2+2 is 4.\n</think>\n\n4", "2+2 is 4.", "4"),
    ("deepseek-r1", None, "Okay, so I need to add 2 and 2.\n</think>\n\n**Answer:** 4",
     "Okay, so I need to add 2 and 2.", "**Answer:** 4"),
    ("deepseek-r1", None, "<think>\nAdd them: 4.\n</think>\n\n4", "Add them: 4.", "4"),
    ("deepseek-r1", None, "Thinking and cut off", "Thinking and cut off", ""),
    ("qwen3", True, "I'll call the tool.\n<tool_call>\n{}\n</tool_call>",
     "I'll call the tool.", "<tool_call>\n{}\n</tool_call>"),
]  # fmt: skip

QWEN3_THEN_CALL = (
    "<think>\nThe user wants the weather in Paris; I should call get_weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>"
)
QWEN3_NO_THINKING_CALL = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def chunks(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 13])
        out.append(text[i : i + n])
        i += n
    return out


def stream(parser: ChatOutputParser, pieces: list[str]) -> tuple[ParsedMessage, list]:
    """Feeds `pieces`; returns the message the deltas add up to, and the tool-call deltas."""
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    calls: dict[int, dict] = {}
    tool_deltas = [d for delta in deltas for d in delta.tool_calls]
    for d in tool_deltas:
        if d.id is not None:
            assert d.index not in calls and d.name and d.arguments == ""
            calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
        calls[d.index]["arguments"] += d.arguments
    reasoning = "".join(d.reasoning_content for d in deltas)
    message = ParsedMessage(
        content="".join(d.content for d in deltas),
        reasoning_content=reasoning or None,
        tool_calls=[calls[i] for i in sorted(calls)],  # type: ignore[misc]
    )
    return message, tool_deltas


def summary(message: ParsedMessage) -> tuple:
    calls = [
        (c["name"], c["arguments"]) if isinstance(c, dict) else (c.name, c.arguments)
        for c in message.tool_calls
    ]
    return message.reasoning_content, message.content, calls


def all_cases() -> list[tuple[str | None, str | None, bool | None, str]]:
    """(tool parser, reasoning parser, in_reasoning, output) for every recorded output."""
    cases = [(p, None, None, text) for p, text, _, _ in TOOL_OUTPUTS]
    cases += [(p, None, None, text) for p, text in MALFORMED]
    cases += [(p, None, None, text) for p in TOOL_CALL_PARSERS for text in PLAIN]
    cases += [(None, p, flag, text) for p, flag, text, _, _ in REASONING_OUTPUTS]
    cases += [("qwen25", "qwen3", flag, QWEN3_THEN_CALL) for flag in (None, False)]
    cases += [("qwen25", "qwen3", None, QWEN3_NO_THINKING_CALL)]
    return cases


def make(tool: str | None, reasoning: str | None, flag: bool | None) -> ChatOutputParser:
    return ChatOutputParser(
        reasoning_parser(reasoning, flag) if reasoning else None,
        tool_call_parser(tool, TOOLS) if tool else None,
    )


@pytest.mark.parametrize(("name", "text", "content", "calls"), TOOL_OUTPUTS)
def test_tool_calls_whole_output(name, text, content, calls):
    found = tool_call_parser(name, TOOLS).parse(text)
    assert found.text == content
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == calls
    assert len({c.id for c in found.calls}) == len(calls)
    assert all(c.id.startswith("call_") for c in found.calls)


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_malformed_calls_are_text(name, text):
    found = tool_call_parser(name, TOOLS).parse(text)
    assert (found.text, found.calls) == (text, [])


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
@pytest.mark.parametrize("text", PLAIN)
def test_output_without_calls_is_unchanged(name, text):
    assert tool_call_parser(name, TOOLS).parse(text).text == text


def test_names_are_checked_against_the_offered_tools():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    assert tool_call_parser("qwen25", ["get_time"]).parse(text).text == text
    assert tool_call_parser("qwen25", None).parse(text).calls[0].name == "get_weather"


@pytest.mark.parametrize(("name", "flag", "text", "reasoning", "content"), REASONING_OUTPUTS)
def test_reasoning_whole_output(name, flag, text, reasoning, content):
    assert reasoning_parser(name, flag).parse(text) == (reasoning, content)


def test_qwen3_without_thinking_calls_a_tool():
    message = chat_output_parser("qwen25", "qwen3", TOOLS).parse(QWEN3_NO_THINKING_CALL)
    assert summary(message) == (None, "Sure.", [("get_time", "{}")])


def test_qwen3_thinking_then_a_tool_call():
    message = chat_output_parser("qwen25", "qwen3", TOOLS).parse(QWEN3_THEN_CALL)
    assert message.reasoning_content == (
        "The user wants the weather in Paris; I should call get_weather."
    )
    assert message.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
        ("get_weather", WEATHER)
    ]
    openai_message = message.as_openai()
    assert openai_message["content"] is None
    assert openai_message["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("seed", range(6))
def test_streams_add_up_to_the_whole_output(seed):
    for tool, reasoning, flag, text in all_cases():
        whole = make(tool, reasoning, flag).parse(text)
        streamed, _ = stream(make(tool, reasoning, flag), chunks(text, seed))
        assert summary(streamed) == summary(whole), (tool, reasoning, text, seed)


def test_every_two_piece_split_adds_up():
    """Every cut point, including inside <think>, </think>, <tool_call>, <|python_tag|>,
    [TOOL_CALLS] and [ARGS]."""
    for tool, reasoning, flag, text in all_cases():
        whole = summary(make(tool, reasoning, flag).parse(text))
        for cut in range(len(text) + 1):
            streamed, _ = stream(make(tool, reasoning, flag), [text[:cut], text[cut:]])
            assert summary(streamed) == whole, (tool, reasoning, text, cut)


def test_partial_tags_are_never_shown():
    parser = make("qwen25", "qwen3", None)
    seen = [parser.feed(piece) for piece in ["<thi", "nk>\nPlan", " it.</th", "ink>\n\nOk <tool"]]
    assert [(d.reasoning_content, d.content) for d in seen] == [
        ("", ""),
        ("Plan", ""),
        (" it.", ""),
        ("", "Ok"),
    ]
    rest = parser.feed('_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert rest.content == "" and [d.name for d in rest.tool_calls] == ["get_time", None]


def test_text_and_reasoning_stream_before_the_output_ends():
    parser = make("qwen25", "qwen3", True)
    assert parser.feed("Let me think about").reasoning_content == "Let me think about"
    assert parser.feed(" it.</think>\n\nHello, ").content == "Hello,"
    assert parser.feed("world. ").content == " world."
    assert parser.finish().content == " "


def test_call_deltas_are_openai_shaped():
    parser = chat_output_parser("mistral", None, TOOLS)
    out = parser.feed(
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]'
    )
    pieces = [d.as_openai() for d in out.tool_calls]
    assert [p["index"] for p in pieces] == [0, 0, 1, 1]
    assert pieces[0]["type"] == "function" and pieces[0]["id"].startswith("call_")
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert pieces[1] == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert parser.calls_made == 2


def test_openai_client_accumulates_the_stream():
    """The official client's stream accumulator rebuilds the non-streamed message."""
    state_mod = pytest.importorskip("openai.lib.streaming.chat")
    from openai.types.chat import ChatCompletionChunk

    text = QWEN3_THEN_CALL.replace("<tool_call>", "Checking.\n<tool_call>", 1)
    whole = chat_output_parser("qwen25", "qwen3", TOOLS).parse(text)
    parser = chat_output_parser("qwen25", "qwen3", TOOLS)
    state = state_mod.ChatCompletionStreamState()
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    deltas = [parser.feed(p) for p in chunks(text, 7)] + [parser.finish()]
    for i, delta in enumerate(deltas):
        body: dict = {"role": "assistant"} if i == 0 else {}
        if delta.content:
            body["content"] = delta.content
        for call in delta.tool_calls:
            choice = {
                "index": 0,
                "delta": {"tool_calls": [call.as_openai()]},
                "finish_reason": None,
            }
            state.handle_chunk(ChatCompletionChunk.model_validate({**head, "choices": [choice]}))
        reason = ("tool_calls" if parser.calls_made else "stop") if i == len(deltas) - 1 else None
        choice = {"index": 0, "delta": body, "finish_reason": reason}
        state.handle_chunk(ChatCompletionChunk.model_validate({**head, "choices": [choice]}))
    message = state.get_final_completion().choices[0].message
    assert message.content == whole.content == "Checking."
    got = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert [(n, a) for _, n, a in got] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert got[0][0].startswith("call_")


def test_prompt_tail_decides_where_the_output_starts():
    thinking_template = "<|im_start|>assistant\n<think>\n"
    no_thinking = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    out = "Plan.\n</think>\n\nDone."
    opened = chat_output_parser(None, "qwen3", prompt_tail=thinking_template)
    assert opened.feed("Plan.").reasoning_content == "Plan."  # streamed at once, not held
    assert summary(opened.parse(out))[:2] == ("Plan.", "Done.")
    closed = chat_output_parser(None, "qwen3", prompt_tail=no_thinking)
    assert closed.parse(out).content == out
    assert chat_output_parser(None, "qwen3", prompt_tail="user: hi").reasoning.in_reasoning is None


def test_registry_uses_sglang_names():
    assert {"qwen25", "qwen", "hermes", "llama3", "mistral"} <= set(TOOL_CALL_PARSERS)
    assert {"qwen3", "qwen3-thinking", "deepseek-r1"} <= set(REASONING_FORMATS)
    assert TOOL_CALL_PARSERS["mistral"].needs_special_tokens
    assert not TOOL_CALL_PARSERS["qwen25"].needs_special_tokens
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        check_parser_names("qwen2.5", None)
    with pytest.raises(ValueError, match="reasoning_parser must be one of .*'qwen3'"):
        reasoning_parser("r1")
