"""OpenAI's constraint requests as grammars: every output a forced tool call's grammar allows is
read back as calls (and nothing else) by the matching --tool-call-parser, a grammar after
reasoning lets the model think first, and bad response_format / tool_choice values are the
caller's error."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from rollout.engine.grammar_openai import (
    after_reasoning,
    forced_tool_names,
    response_format_grammar,
    tool_call_grammar,
)
from rollout.engine.grammar_spec import GrammarSpec
from rollout.errors import InvalidRequest
from rollout.parsers import TOOL_CALL_PARSERS

xgr = pytest.importorskip("xgrammar")

ARGS = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
}
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": ARGS}},
    {"type": "function", "function": {"name": "noop"}},  # no parameters: any object
]


@pytest.fixture(scope="module")
def backend(tiny_qwen2):
    from transformers import AutoTokenizer

    from rollout.engine.grammar_backend import GrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    backend = GrammarBackend(tokenizer, 1024, [tokenizer.eos_token_id])
    backend.tokenizer = tokenizer
    yield backend
    backend.close()


def _random_walk(backend, tag: str, seed: int, limit: int = 4000) -> str:
    """A random output the grammar allows, up to its end (EOS excluded)."""
    grammar = backend.matcher(GrammarSpec("structural_tag", tag))
    gen = torch.Generator().manual_seed(seed)
    bitmask = torch.empty((1, 32), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    out: list[int] = []
    for _ in range(limit):
        grammar.fill(bitmask, 0)
        allowed = ((bitmask[0, :, None] >> shifts) & 1).flatten().bool()
        # Favour ending: a random walk in an unbounded object would wander far.
        weights = allowed.float() * torch.rand(1024, generator=gen)
        weights[backend.tokenizer.eos_token_id] *= 50
        token = int(torch.multinomial(weights, 1, generator=gen))
        out.append(token)
        grammar.advance(out)
        if grammar.terminated:
            return backend.tokenizer.decode(out[:-1])
    raise AssertionError("the grammar did not end")


@pytest.mark.parametrize("parser", ["hermes", "qwen25", "llama3", "mistral"])
@pytest.mark.parametrize("choice", ["required", "named", "single"])
def test_forced_tool_calls_parse_back_as_calls(backend, parser, choice):
    tool_choice = (
        {"type": "function", "function": {"name": "add"}} if choice == "named" else "required"
    )
    names = forced_tool_names(TOOLS, tool_choice)
    tag = tool_call_grammar(
        parser, TOOLS, names, parallel=choice != "single", one=choice == "named"
    )
    for seed in range(4):
        text = _random_walk(backend, tag, seed)
        parsed = TOOL_CALL_PARSERS[parser](["add", "noop"]).parse(text)
        assert parsed.calls and not parsed.text.strip(), text
        if choice != "required":
            assert len(parsed.calls) == 1
        for call in parsed.calls:
            assert choice != "named" or call.name == "add"
            if call.name == "add":
                jsonschema.validate(json.loads(call.arguments), ARGS)


def _accepts(backend, fields: dict[str, str], text: str) -> bool:
    ((kind, value),) = fields.items()
    grammar = backend.matcher(GrammarSpec(kind, value))
    return grammar.matcher.accept_string(text) and grammar.matcher.is_completed()


def test_reasoning_comes_before_the_grammar(backend):
    answer = response_format_grammar({"type": "json_schema", "json_schema": {"schema": ARGS}})
    undecided = after_reasoning(answer, None, "<think>", "</think>")
    assert _accepts(backend, undecided, '<think>Two plus two.</think>\n\n{"a": 4}')
    assert _accepts(backend, undecided, '{"a": 4}')
    assert not _accepts(backend, undecided, 'Sure: {"a": 4}')
    inside = after_reasoning(answer, True, "<think>", "</think>")
    assert _accepts(backend, inside, 'Two plus two.</think>\n{"a": 4}')
    assert not _accepts(backend, inside, '{"a": 4}')
    assert after_reasoning(answer, False, "<think>", "</think>") == answer
    assert after_reasoning({}, None, "<think>", "</think>") == {}


def test_response_formats():
    assert response_format_grammar(None) == {} == response_format_grammar({"type": "text"})
    assert json.loads(response_format_grammar({"type": "json_object"})["json_schema"]) == {
        "type": "object"
    }
    with pytest.raises(InvalidRequest, match="response_format.json_schema.schema"):
        response_format_grammar({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(InvalidRequest, match="response_format.type"):
        response_format_grammar({"type": "xml"})


def test_tool_choices():
    assert forced_tool_names(TOOLS, "auto") is None and forced_tool_names(TOOLS, "none") is None
    assert forced_tool_names(TOOLS, "required") == ["add", "noop"]
    with pytest.raises(InvalidRequest, match="at least one tool"):
        forced_tool_names([], "required")
    with pytest.raises(InvalidRequest, match="'missing', which is not among the tools"):
        forced_tool_names(TOOLS, {"type": "function", "function": {"name": "missing"}})
    with pytest.raises(InvalidRequest, match="tool_choice must be"):
        forced_tool_names(TOOLS, "always")
