"""One request type in, one output type out: generate's arguments are GenerateRequest's fields
everywhere (engine sync/async, client, /generate); the control methods are their calls' fields;
a request's outputs extend into one and turn into SGLang's logprob entries in one place."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

import pytest

from rollout import RolloutEngine
from rollout.client import RolloutClient
from rollout.control_api import ControlAPI
from rollout.engine.messages import LogprobColumns, ReqOutput
from rollout.errors import InvalidRequest, InvalidRequestType
from rollout.generate_request import GenerateRequest
from rollout.weight_sync import calls

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
FIELDS = [f.name for f in dataclasses.fields(GenerateRequest)]


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cpu", max_total_tokens=2048) as eng:
        yield eng


@pytest.mark.parametrize(
    "method",
    [
        RolloutEngine.generate,
        RolloutEngine.async_generate,
        RolloutEngine.validate_generate,
        RolloutClient.generate,
        RolloutClient.async_generate,
    ],
)
def test_every_generate_takes_the_fields_of_generate_request(method):
    params = list(inspect.signature(method).parameters)
    assert params == ["self", *FIELDS]


def test_async_generate_stays_a_coroutine_function():
    assert inspect.iscoroutinefunction(RolloutEngine.async_generate)
    assert inspect.iscoroutinefunction(RolloutClient.async_generate)


@pytest.mark.parametrize("name", [c.method for c in calls.WEIGHT_CALLS])
def test_control_methods_take_their_calls_fields(name):
    call = next(c for c in calls.WEIGHT_CALLS if c.method == name)
    if name in ControlAPI.__dict__:
        params = list(inspect.signature(getattr(ControlAPI, name)).parameters)
        assert params == ["self", *(f.name for f in dataclasses.fields(call))]
        assert getattr(ControlAPI, name).__doc__ == call.__doc__
    assert callable(getattr(RolloutEngine, name)) and callable(getattr(RolloutClient, name))


def test_json_round_trip_uses_the_wire_names():
    request = GenerateRequest(prompt="hi", sampling_params=GREEDY, return_logprob=True, rid="r")
    body = request.to_json()
    assert body["text"] == "hi" and "prompt" not in body and "input_ids" not in body
    assert GenerateRequest.from_json(body) == request


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"return_logprob": "yes"}, "return_logprob"),
        ({"stream": 1}, "stream"),
        ({"top_logprobs_num": 2.5}, "top_logprobs_num"),
        ({"logprob_start_len": True}, "logprob_start_len"),
        ({"rid": 7}, "rid"),
        ({"rid": ["a", 3]}, "rid"),
    ],
)
def test_a_field_of_the_wrong_type_is_named(kwargs, name):
    with pytest.raises(InvalidRequestType, match=name):
        GenerateRequest(input_ids=[1, 2], **kwargs)


def test_engine_takes_a_request_object_or_its_fields(engine):
    by_fields = engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    by_position = engine.generate(None, GREEDY, [5, 6, 7])
    by_object = engine.generate(GenerateRequest(input_ids=[5, 6, 7], sampling_params=GREEDY))
    assert by_fields["output_ids"] == by_position["output_ids"] == by_object["output_ids"]
    awaited = asyncio.run(
        engine.async_generate(GenerateRequest(input_ids=[5, 6, 7], sampling_params=GREEDY))
    )
    assert awaited["output_ids"] == by_fields["output_ids"]
    with pytest.raises(TypeError):
        engine.generate(input_ids=[5, 6, 7], no_such_field=1)


@pytest.mark.parametrize("rid", ["same", ["d", "d"]])
def test_a_batch_that_names_two_prompts_alike_is_refused_before_it_runs(engine, rid):
    with pytest.raises(InvalidRequest, match="rid must name each prompt of a batch once"):
        engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY, rid=rid)
    assert engine.get_server_info()["num_running"] == 0
    assert engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY, rid=["d0", "d1"])


def test_return_text_in_logprobs_fills_each_entry_with_its_token_text(engine):
    out = engine.generate(
        input_ids=[5, 6, 7, 8], sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
        top_logprobs_num=2, token_ids_logprob=[3], return_text_in_logprobs=True,
    )  # fmt: skip
    meta = out["meta_info"]
    decode = engine.tokenizer.decode
    for _, tid, text in meta["output_token_logprobs"]:
        assert text == decode([tid])
    for entries in meta["output_top_logprobs"] + meta["output_token_ids_logprobs"]:
        assert [e[2] for e in entries] == [decode([e[1]]) for e in entries]
    assert meta["input_token_logprobs"][0][0] is None  # the first prompt token has no logprob
    plain = engine.generate(
        input_ids=[5, 6, 7, 8], sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2
    )["meta_info"]
    assert all(e[2] is None for e in plain["output_token_logprobs"])
    # The same tokens (the second run reuses the prompt's cached KV: logprobs agree to rounding).
    assert [e[1] for e in plain["output_token_logprobs"]] == [
        e[1] for e in meta["output_token_logprobs"]
    ]
    lps = [e[0] for e in meta["output_token_logprobs"]]
    assert [e[0] for e in plain["output_token_logprobs"]] == pytest.approx(lps, abs=1e-5)


def test_outputs_extend_into_one():
    first = ReqOutput("r", [1], None, 3, 1, 0, "v1", logprobs=LogprobColumns(), text="a")
    first.logprobs.add_prompt([(None, 9), (-0.5, 8)], [None, [(-0.5, 8)]], [None, None])
    first.logprobs.add_token((-1.0, 1), [(-1.0, 1)], None)
    later = ReqOutput(
        "r", [2], {"type": "length"}, 3, 2, 1, "v2", logprobs=LogprobColumns(), text="b"
    )
    later.logprobs.add_token((-2.0, 2), [(-2.0, 2)], [(-3.0, 4)])
    later.weight_version_changes = [{"offset": 1, "weight_version": "v2"}]
    first.extend(later)
    assert (first.new_ids, first.text, first.weight_version, first.cached_tokens) == (
        [1, 2],
        "ab",
        "v2",
        1,
    )
    assert first.finish_reason == {"type": "length"} and first.completion_tokens == 2
    assert first.weight_version_changes == [{"offset": 1, "weight_version": "v2"}]
    entries = first.logprobs.entries(lambda tid: f"<{tid}>")
    assert entries["output_token_logprobs"] == [(-1.0, 1, "<1>"), (-2.0, 2, "<2>")]
    assert entries["output_token_ids_logprobs"] == [None, [(-3.0, 4, "<4>")]]
    assert entries["input_token_logprobs"] == [(None, 9, "<9>"), (-0.5, 8, "<8>")]
    assert entries["input_top_logprobs"] == [None, [(-0.5, 8, "<8>")]]
    assert first.logprobs.entries()["output_top_logprobs"] == [[(-1.0, 1, None)], [(-2.0, 2, None)]]


def test_logprob_entries_made_in_parts_are_the_entries_made_at_once():
    """What the tokenizer manager makes between turns of its event loop (entries_in_parts):
    parts of about `part` entries, the same columns in the end."""
    columns = LogprobColumns()
    columns.add_prompt(
        [(None, 1)] + [(-0.1 * i, i) for i in range(1, 300)],
        [None] + [[(-0.2 * j, j) for j in range(5)] for _ in range(299)],
        [None] * 300,
    )
    for i in range(200):
        columns.add_token((-0.3, i), [(-0.4, j) for j in range(5)], [(-0.5, 7)] if i % 2 else None)
    text_of = lambda tid: f"<{tid}>"  # noqa: E731
    parts = list(columns.entries_in_parts(text_of, part=64))
    assert parts[-1] == columns.entries(text_of) and all(p is None for p in parts[:-1])
    total = 200 * 3 + 200 * 5 + 100 + 300 + 299 * 6 + 300  # entries and per-position lists
    assert total // 64 - 8 <= len(parts) - 1 <= total // 64 + 8  # every ~64 entries
    assert list(columns.entries_in_parts(text_of)) == [columns.entries(text_of)]
