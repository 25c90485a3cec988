"""Partial rollouts as RL frameworks use them (slime, AReaL): an aborted request, running or still
queued, returns what it produced so far with finish_reason abort; resending prompt + those tokens
with the remaining budget continues it exactly (greedy) as if it had never stopped."""

from __future__ import annotations

import threading
import time

import pytest

from rollout.engine.engine import RolloutEngine

PROMPT = [5, 17, 42, 99, 123, 7]
BUDGET = 40
GREEDY = {"temperature": 0, "max_new_tokens": BUDGET, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cpu") as eng:
        yield eng


def _tokens_and_logprobs(out: dict) -> tuple[list[int], list[float]]:
    entries = out["meta_info"]["output_token_logprobs"]
    return [e[1] for e in entries], [e[0] for e in entries]


def _abort_after(engine: RolloutEngine, rid: str, k: int) -> dict:
    """Streams the greedy request and aborts it once it has k tokens; its last output."""
    last, sent = None, False
    stream = engine.generate(
        input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, rid=rid, stream=True
    )
    for last in stream:
        if len(last["output_ids"]) >= k and not sent:
            engine.abort_request(rid=rid)
            sent = True
    return last


def test_an_aborted_running_request_returns_its_tokens_and_logprobs(engine):
    out = _abort_after(engine, "partial-1", 8)
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    ids, logprobs = _tokens_and_logprobs(out)
    assert 8 <= len(out["output_ids"]) < BUDGET
    assert ids == out["output_ids"] and len(logprobs) == len(ids)
    assert meta["completion_tokens"] == len(ids)
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": len(ids)}]


def test_resuming_with_the_remaining_budget_equals_an_uninterrupted_run(engine):
    whole = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    ref_ids, ref_logprobs = _tokens_and_logprobs(whole)
    part = _abort_after(engine, "partial-2", 10)
    got = list(part["output_ids"])
    _, got_logprobs = _tokens_and_logprobs(part)
    # What AReaL and slime send: prompt + the tokens so far, the budget less what was produced.
    params = {**GREEDY, "max_new_tokens": BUDGET - len(got)}
    rest = engine.generate(input_ids=PROMPT + got, sampling_params=params, return_logprob=True)
    rest_ids, rest_logprobs = _tokens_and_logprobs(rest)
    assert rest["meta_info"]["finish_reason"]["type"] == "length"
    assert got + rest_ids == ref_ids
    assert got_logprobs + rest_logprobs == pytest.approx(ref_logprobs, abs=1e-4)


def test_an_aborted_queued_request_returns_abort_with_no_tokens(engine):
    engine.pause_generation(mode="in_place")  # nothing steps: the request waits in the queue
    try:
        stream = engine.generate(
            input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True, rid="queued", stream=True
        )
        engine.abort_request(rid="queued")
        outs = list(stream)
    finally:
        engine.continue_generation()
    meta = outs[-1]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert outs[-1]["output_ids"] == [] and meta["output_token_logprobs"] == []
    # Resent whole, it runs as a fresh request.
    again = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert again["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_all_during_a_batch_returns_each_partial_output(engine):
    results: dict = {}
    params = {**GREEDY, "max_new_tokens": 1500}

    def run() -> None:
        results["outs"] = engine.generate(
            input_ids=[PROMPT, PROMPT[:3]], sampling_params=params, return_logprob=True
        )

    worker = threading.Thread(target=run)
    worker.start()
    before = engine.get_server_info()["generated_tokens"]
    while engine.get_server_info()["generated_tokens"] < before + 10:
        time.sleep(0.01)
    engine.abort_request(abort_all=True)
    worker.join(timeout=60)
    for out in results["outs"]:
        ids, logprobs = _tokens_and_logprobs(out)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(ids) < 1500 and ids == out["output_ids"] and len(logprobs) == len(ids)
