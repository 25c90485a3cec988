"""Overlapped scheduling gives the same results as stepping one batch at a time.

The scheduler runs in-process (CPU, float32, tiny model) over one varied batch: mixed prompt
lengths, chunked prefill, greedy and seeded sampling, penalties, min_new_tokens, stop ids and
strings, logprobs, hidden states, n samples of a prompt, prefill-only requests, a KV pool small
enough to retract, and an abort. Then the same through the engine's processes, streaming."""

from __future__ import annotations

import copy
import random

import pytest

from rollout import RolloutEngine
from rollout.config import EngineOptions
from rollout.engine.messages import AbortRequest, TokenizedRequest
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.scheduler_process import SchedulerProcess

KV_TOKENS = 400
ABORTED, ABORT_AT_STEP = "abort-me", 12


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _requests(stops: dict[str, dict] | None = None) -> list[TokenizedRequest]:
    """The batch; `stops` adds stop ids/strings (picked from an earlier run's outputs) by rid."""
    stops = stops or {}
    specs: list[tuple[str, list[int], dict, dict]] = [
        (ABORTED, _ids(14, 28), {"temperature": 0, "max_new_tokens": 200}, {}),
        ("greedy-short", _ids(1, 3), {"temperature": 0, "max_new_tokens": 30}, {}),
        ("greedy-long", _ids(2, 110), {"temperature": 0, "max_new_tokens": 40}, {}),
        ("sampled", _ids(3, 45), {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 35}, {}),
        ("top-k", _ids(4, 20), {"temperature": 1.3, "top_k": 20, "min_p": 0.05, "max_new_tokens": 25}, {}),
        ("repetition", _ids(5, 30), {"repetition_penalty": 1.3, "max_new_tokens": 30}, {}),
        ("frequency", _ids(6, 12), {"frequency_penalty": 0.8, "presence_penalty": 0.5, "max_new_tokens": 30}, {}),
        ("min-new", _ids(7, 25), {"temperature": 0, "min_new_tokens": 20, "max_new_tokens": 30}, {}),
        ("stop-id", _ids(8, 40), {"temperature": 0.8, "max_new_tokens": 40}, {}),
        ("stop-str", _ids(9, 60), {"temperature": 0, "max_new_tokens": 40}, {}),
        ("logprobs", _ids(10, 35), {"temperature": 1.0, "max_new_tokens": 20},
         {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3, "token_ids_logprob": [5, 6]}),
        ("prompt-only", _ids(11, 70), {"max_new_tokens": 0},
         {"return_logprob": True, "logprob_start_len": 30, "top_logprobs_num": 2}),
        ("hidden", _ids(12, 15), {"temperature": 0, "max_new_tokens": 12}, {"return_hidden_states": True}),
        ("stream", _ids(13, 50), {"temperature": 0.7, "max_new_tokens": 30}, {"stream": True}),
    ]  # fmt: skip
    specs += [
        (f"sample-{i}", _ids(15, 80), {"temperature": 1.0, "max_new_tokens": 24}, {})
        for i in range(4)
    ]
    reqs = []
    for i, (rid, ids, params, extra) in enumerate(specs):
        params = {"ignore_eos": True, **params, **stops.get(rid, {})}
        reqs.append(TokenizedRequest(rid, ids, SamplingParams(**params), seed=1000 + i, **extra))
    return reqs


def _run(path: str, reqs: list[TokenizedRequest], overlap: bool, abort: bool) -> tuple[dict, dict]:
    """Steps the scheduler until idle. Returns each request's accumulated outputs and facts
    about the run."""
    options = EngineOptions.from_kwargs(
        model_path=path, device="cpu", dtype="float32", max_total_tokens=KV_TOKENS,
        chunked_prefill_size=48, disable_overlap_schedule=not overlap,
    )  # fmt: skip
    proc = SchedulerProcess(options)
    sched = proc.scheduler
    facts = {"resolved_behind_a_launch": 0, "dropped_kv": 0}
    resolve, truncate = sched.runner.resolve, sched.kv.truncate

    def spy_resolve(step):
        facts["resolved_behind_a_launch"] += sched.in_flight is not None
        return resolve(step)

    def spy_truncate(req, kv_len):
        facts["dropped_kv"] += req.row is not None and req.kv_len > kv_len
        truncate(req, kv_len)

    sched.runner.resolve, sched.kv.truncate = spy_resolve, spy_truncate
    for treq in reqs:
        sched.add_request(copy.deepcopy(treq))
    results: dict[str, dict] = {}

    def collect(done) -> None:
        for req in done:
            out = sched.make_output(req)
            acc = results.setdefault(out.rid, {"ids": [], "chunks": 0})
            acc["ids"] += out.new_ids
            acc["chunks"] += 1
            acc.update(
                finish=out.finish_reason, cached=out.cached_tokens, completion=out.completion_tokens
            )
            columns = out.logprobs.entries() if out.logprobs is not None else {}
            columns["hidden_states"] = out.hidden_states or []
            for key, values in columns.items():
                acc.setdefault(key, []).extend(values)

    steps = 0
    while sched.has_work():
        collect(sched.step())
        steps += 1
        if abort and steps == ABORT_AT_STEP:
            sched.abort(AbortRequest(rid=ABORTED))
    collect(sched.take_reports())
    info = sched.server_info()
    facts.update(
        retractions=info["retractions"],
        kv_whole=info["kv_whole"],
        flushed=sched.flush_cache()["success"],
    )
    facts["kv_free_after_flush"] = sched.kv.allocator.available() == sched.runner.num_slots
    return results, facts


def _close(a, b) -> bool:
    """Equal, but floats (logprobs, hidden states) only to 1e-5: batches of different
    composition may round differently. Token ids, counts and reasons must match exactly."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


@pytest.fixture(scope="module")
def stops(tiny_qwen3) -> dict[str, dict]:
    """Stop ids and strings that the stop-id and stop-str requests will meet midway."""
    from transformers import AutoTokenizer

    reference, _ = _run(tiny_qwen3, _requests(), overlap=False, abort=False)
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    stop_id = reference["stop-id"]["ids"][9]
    text = tok.decode(reference["stop-str"]["ids"][:30])
    return {
        "stop-id": {"stop_token_ids": [stop_id]},
        "stop-str": {"stop": [text[len(text) // 2 : len(text) // 2 + 3]]},
        "min-new": {"stop_token_ids": reference["min-new"]["ids"][2:4]},  # banned until 20 tokens
    }


def test_overlap_on_and_off_give_identical_results(tiny_qwen3, stops):
    reqs = _requests(stops)
    off, off_facts = _run(tiny_qwen3, reqs, overlap=False, abort=True)
    on, on_facts = _run(tiny_qwen3, reqs, overlap=True, abort=True)
    assert on_facts["resolved_behind_a_launch"] > 0 and off_facts["resolved_behind_a_launch"] == 0
    assert on_facts["dropped_kv"] > 0  # some request finished while its next decode ran
    for facts in (on_facts, off_facts):
        assert facts["retractions"] > 0
        assert facts["kv_whole"] and facts["flushed"] and facts["kv_free_after_flush"], facts
    assert sorted(on) == sorted(off) == sorted(r.rid for r in reqs)
    for rid in off:
        if rid == ABORTED:
            continue
        # Not compared: how many chunks streamed, and cached_tokens (both follow the schedule:
        # with overlap, finished requests free their KV a step later).
        unscheduled = {"chunks": 0, "cached": 0}
        assert _close(on[rid] | unscheduled, off[rid] | unscheduled), rid
    assert off["stop-id"]["finish"]["type"] == off["stop-str"]["finish"]["type"] == "stop"
    assert off["min-new"]["completion"] >= 20  # its stop ids came at tokens 3 and 4 unbanned
    assert len(off["prompt-only"]["input_token_logprobs"]) == 70 - 30
    assert on["stream"]["chunks"] > 1
    # Aborted midway in both (how far it got follows the schedule), with the same tokens.
    full = {r.rid: r for r in reqs}[ABORTED].params.max_new_tokens
    for result in (on, off):
        assert result[ABORTED]["finish"]["type"] == "abort"
        assert 0 < len(result[ABORTED]["ids"]) < full
    common = min(len(on[ABORTED]["ids"]), len(off[ABORTED]["ids"]))
    assert on[ABORTED]["ids"][:common] == off[ABORTED]["ids"][:common]


def _what_users_get(out: dict) -> tuple:
    """The parts of a generate result that must not depend on overlap."""
    meta = out["meta_info"]
    return out["text"], out["output_ids"], meta["finish_reason"], meta["output_token_logprobs"]


def test_engine_streams_the_same_with_and_without_overlap(tiny_qwen2):
    prompts = [_ids(40 + i, 10 + 9 * i) for i in range(6)]
    params = [
        {"temperature": 0, "max_new_tokens": 20, "stop": ["e"]},
        {"temperature": 0.8, "max_new_tokens": 25, "seed": 3, "ignore_eos": True},
        {"temperature": 1.0, "max_new_tokens": 15, "n": 3, "seed": 5},
        {"repetition_penalty": 1.2, "max_new_tokens": 18, "seed": 9},
        {"temperature": 0, "max_new_tokens": 22, "ignore_eos": True, "min_new_tokens": 22},
        {"temperature": 0.5, "max_new_tokens": 12, "stop_token_ids": [7, 8, 9], "seed": 1},
    ]
    results = []
    for disable in (True, False):
        with RolloutEngine(
            tiny_qwen2,
            dtype="float32",
            device="cpu",
            max_total_tokens=256,
            disable_overlap_schedule=disable,
        ) as engine:
            whole = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
            streamed = [
                list(engine.generate(input_ids=p, sampling_params=q, stream=True))
                for p, q in zip(prompts, params)
                if "n" not in q
            ]
            info = engine.get_server_info()
        assert info["kv_whole"] and info["num_running"] == 0
        results.append((whole, streamed))
    (off, off_streamed), (on, on_streamed) = results
    assert _close([_what_users_get(o) for o in on], [_what_users_get(o) for o in off])
    for on_chunks, off_chunks in zip(on_streamed, off_streamed):
        assert on_chunks[-1]["text"] == off_chunks[-1]["text"]
        assert on_chunks[-1]["output_ids"] == off_chunks[-1]["output_ids"]


def test_overlap_computes_no_token_past_a_requests_max_new_tokens(tiny_qwen3):
    # The token in flight is a request's last: no decode step is launched for it after that
    # (one for max_new_tokens=1 would double the work of a one-token request).
    proc = SchedulerProcess(EngineOptions.from_kwargs(
        model_path=tiny_qwen3, device="cpu", dtype="float32", max_total_tokens=KV_TOKENS,
    ))  # fmt: skip
    sched, launched = proc.scheduler, []
    launch = sched.runner.launch
    sched.runner.launch = lambda batch: launched.append(len(batch.reqs)) or launch(batch)
    for max_new in (1, 5):
        launched.clear()
        params = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
        sched.add_request(TokenizedRequest(f"r{max_new}", [4, 8, 15, 16], params, seed=0))
        done = []
        while sched.has_work():
            done += [r for r in sched.step() if r.finished]
        assert [len(r.output_ids) for r in done] == [max_new]
        assert len(launched) == max_new  # the prefill, then max_new - 1 decodes
