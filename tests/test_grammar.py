"""Constrained outputs (xgrammar) through RolloutEngine: json_schema, regex and ebnf outputs
always match, the grammar ends the output, a bad grammar is the caller's error, and requests
without a grammar in the same batch get the tokens they would alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from rollout import RolloutEngine
from rollout.engine.grammar_backend import GrammarBackend
from rollout.engine.grammar_mask import mask_logits
from rollout.engine.grammar_spec import GrammarSpec
from rollout.engine.sampling_params import SamplingParams
from rollout.errors import InvalidRequest

pytest.importorskip("xgrammar")

# Strings are enums or short: with the tiny model's random logits, an unbounded string would
# rarely close. The grammar must end every output well within max_new_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 30},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "note": {"type": "string", "pattern": "^[a-z]{1,4}$"},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "days", "ok", "note"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}@[0-9]{1,3}\.(com|org)"
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'


@pytest.fixture(scope="module")
def engine(tiny_qwen2):
    with RolloutEngine(tiny_qwen2, dtype="float32", device="cpu", max_total_tokens=8192) as eng:
        yield eng


def test_json_schema_outputs_always_validate(engine):
    params = {"temperature": 1.0, "max_new_tokens": 96, "n": 100, "seed": 7, "json_schema": SCHEMA}
    outs = engine.generate(prompt="Plan a trip:", sampling_params=params)
    assert len(outs) == 100
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert len({out["text"] for out in outs}) > 10  # sampled, not one forced string


def test_regex_and_ebnf_outputs_match(engine):
    for field, grammar in (("regex", REGEX), ("ebnf", EBNF)):
        params = {"temperature": 1.0, "max_new_tokens": 48, "n": 20, "seed": 1, field: grammar}
        outs = engine.generate(prompt="Hello there", sampling_params=params)
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            if field == "regex":
                assert re.fullmatch(REGEX, out["text"]), out["text"]
            else:
                assert re.fullmatch(r"\((?:[0-9x])(?:,[0-9x])*\)", out["text"]), out["text"]


def test_json_object_outputs_that_end_parse(engine):
    # Any object: its strings are unbounded, so only some samples end in 32 tokens.
    params = {"temperature": 1.0, "max_new_tokens": 32, "n": 30, "seed": 3,
              "json_schema": {"type": "object"}}  # fmt: skip
    outs = engine.generate(prompt="Hello there", sampling_params=params)
    ended = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert ended
    for out in ended:
        assert isinstance(json.loads(out["text"]), dict)
    for out in outs:
        assert out["text"].startswith("{")


def test_greedy_constrained_output_is_the_allowed_argmax(engine):
    # Greedy and a grammar of two choices: the output is one of them, and the same every time.
    params = {"temperature": 0, "max_new_tokens": 16, "regex": "(yes|no)"}
    first = engine.generate(prompt="Is it?", sampling_params=params)
    again = engine.generate(prompt="Is it?", sampling_params=params)
    assert first["text"] in ("yes", "no") and again["output_ids"] == first["output_ids"]


def test_requests_without_a_grammar_are_unchanged_beside_constrained_ones(engine):
    prompts = ["The quick brown fox", "Once upon a time", "Numbers 0123", "Hello there"]
    plain = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    alone = engine.generate(prompt=prompts, sampling_params=plain)
    constrained = {"temperature": 1.0, "max_new_tokens": 64, "seed": 5, "json_schema": SCHEMA}
    mixed = engine.generate(
        prompt=prompts + prompts,
        sampling_params=[plain] * len(prompts) + [constrained] * len(prompts),
    )
    assert [o["output_ids"] for o in mixed[: len(prompts)]] == [o["output_ids"] for o in alone]
    for out in mixed[len(prompts) :]:
        jsonschema.validate(json.loads(out["text"]), SCHEMA)


@pytest.mark.parametrize("skip", [True, False], ids=["skipped", "kept"])
def test_a_special_token_is_to_the_grammar_what_the_text_shows(engine, skip):
    # <|im_start|> (id 1) pushed hard. Skipped, it adds nothing to the text: were the grammar
    # to take it for "<|im_start|>", the text would lack what the grammar matched. Kept, it is
    # that text, which the pattern allows.
    pattern = r"[a-z<|_>]+"
    params = {"temperature": 1.0, "max_new_tokens": 8, "seed": 0, "regex": pattern,
              "logit_bias": {"1": 30.0}, "skip_special_tokens": skip}  # fmt: skip
    out = engine.generate(prompt="Hello", sampling_params=params)
    assert re.fullmatch(pattern, out["text"]), out
    assert ("<|im_start|>" in out["text"]) is not skip


def test_streamed_constrained_output_equals_the_whole(engine):
    params = {"temperature": 1.0, "max_new_tokens": 64, "seed": 11, "json_schema": SCHEMA}
    whole = engine.generate(prompt="Plan:", sampling_params=params)
    chunks = list(engine.generate(prompt="Plan:", sampling_params=params, stream=True))
    assert chunks[-1]["text"] == whole["text"]
    jsonschema.validate(json.loads(whole["text"]), SCHEMA)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"json_schema": "{not json"}, "json_schema must be valid JSON"),
        ({"json_schema": {"type": "nonsense"}}, "json_schema is not a valid JSON schema"),
        ({"regex": "[a-"}, "regex is not a valid regular expression"),
        ({"ebnf": "root ::= missing"}, "ebnf is not a valid EBNF grammar"),
        ({"regex": "a", "json_schema": {"type": "object"}}, "only one of"),
        ({"regex": "a", "ignore_eos": True}, "ignore_eos"),
        ({"regex": "a", "min_new_tokens": 2}, "min_new_tokens"),
    ],
)
def test_bad_grammars_are_the_callers_error(engine, params, match):
    with pytest.raises(InvalidRequest, match=match):
        engine.generate(prompt="hi", sampling_params={"max_new_tokens": 4, **params})


def test_params_round_trip_with_a_grammar():
    params = SamplingParams(json_schema={"type": "object"})
    assert params.grammar == GrammarSpec("json_schema", json.dumps({"type": "object"}))
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert SamplingParams().grammar is None


def test_mask_keeps_exactly_the_tokens_the_grammar_allows(tiny_qwen2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    V = 1024  # wider than the tokenizer: the ids past it are never allowed
    backend = GrammarBackend(tokenizer, V, [tokenizer.eos_token_id])
    grammar = backend.matcher(GrammarSpec("regex", "ab[0-9]"))
    grammar.advance(tokenizer.encode("a"))
    logits = torch.zeros(3, V)
    mask_logits(logits, [1], [grammar])
    assert torch.equal(logits[0], torch.zeros(V)) and torch.equal(logits[2], torch.zeros(V))
    allowed = {i for i in range(V) if logits[1, i] == 0}
    # Every allowed token continues "a" within the pattern, and "b" is among them.
    assert tokenizer.convert_tokens_to_ids("b") in allowed
    for token in allowed:
        assert re.fullmatch(r"b(?:[0-9])?", tokenizer.decode([token])), tokenizer.decode([token])
    assert not any(t >= len(tokenizer) for t in allowed)
    backend.close()


class _Backend:
    """Compiles nothing: each submit's future is completed by the test."""

    def __init__(self) -> None:
        self.futures: list = []

    def submit(self, spec, skip_special_tokens=True):
        from concurrent.futures import Future

        self.futures.append(Future())
        return self.futures[-1]


def _req(rid: str, **params):
    from rollout.engine.messages import TokenizedRequest
    from rollout.engine.req import Req

    treq = TokenizedRequest(rid, [1, 2, 3], SamplingParams(**params), 0)
    return Req(req=treq, max_new_tokens=8)


def test_grammar_queue_admits_compiled_requests_in_order_and_drops_aborted_ones():
    from rollout.engine.grammar_queue import GrammarQueue

    backend = _Backend()
    queue = GrammarQueue(lambda: backend)
    a, b, c = (_req(rid, regex="a+") for rid in "abc")
    for req in (a, b, c):
        queue.add(req)
        assert req.penalizes  # its mask reads its tokens: they must be on the host first
    assert len(queue) == 3 and queue.take_ready(idle=True) == ([], [])
    c.finish_reason = {"type": "abort"}  # aborted while compiling
    backend.futures[1].set_result("grammar b")
    backend.futures[0].set_exception(RuntimeError("no"))
    ready, failed = queue.take_ready(idle=False)
    assert ready == [b] and b.grammar == "grammar b"
    assert [(r.rid, str(e)) for r, e in failed] == [("a", "no")]
    assert len(queue) == 0 and backend.futures[2].cancelled()
