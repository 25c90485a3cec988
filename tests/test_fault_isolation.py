"""An exception while serving one request fails that request alone: it gets a short error, the
other requests finish as they would have, every KV slot comes back, and the engine serves on.
When a scheduler process does die, the engine says so at once, the log says why, and callers
get a short EngineDeadError (issue 18)."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import signal
import time

import pytest

from rollout import RolloutEngine
from rollout.config import EngineOptions
from rollout.engine.detokenizer import Detokenizer
from rollout.engine.messages import ReqOutput, TokenizedRequest
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.scheduler_process import SchedulerProcess
from rollout.engine.tokenizer_manager import EngineDeadError, RequestFailedError
from rollout.forward.forward_batch import ForwardMode

KV_TOKENS = 512
SECRET = "/srv/secret/module.py"  # in the injected error: must not reach the request's message


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 17) % 400 + 3 for i in range(n)]


def _good() -> list[TokenizedRequest]:
    specs = [(0, 0.0, 20), (1, 0.0, 45), (2, 0.8, 30)]  # (seed, temperature, prompt length)
    return [
        TokenizedRequest(
            f"good-{seed}",
            _ids(seed, n),
            SamplingParams(temperature=t, max_new_tokens=10, ignore_eos=True),
            seed=seed,
        )  # fmt: skip
        for seed, t, n in specs
    ]


def _bad(input_ids: list[int] | None = None) -> TokenizedRequest:
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    return TokenizedRequest("bad", _ids(7, 30) if input_ids is None else input_ids, params, seed=7)


def _scheduler(path: str, overlap: bool):
    options = EngineOptions.from_kwargs(
        model_path=path, device="cpu", dtype="float32", max_total_tokens=KV_TOKENS,
        chunked_prefill_size=32, disable_overlap_schedule=not overlap,
    )  # fmt: skip
    return SchedulerProcess(options).scheduler


def _serve(sched, bad: TokenizedRequest | None) -> dict[str, dict]:
    """The good requests, then (once they decode) `bad`, then one more good request after all
    finished. Returns each request's ids and finish reason."""
    results: dict[str, dict] = {}

    def collect(done) -> None:
        for req in done:
            out = sched.make_output(req)
            acc = results.setdefault(out.rid, {"ids": []})
            acc["ids"] += out.new_ids
            acc["finish"] = out.finish_reason

    def run() -> None:
        while sched.has_work():
            collect(sched.step())
        collect(sched.take_reports())

    for treq in _good():
        sched.add_request(copy.deepcopy(treq))
    for _ in range(4):
        collect(sched.step())
    if bad is not None:
        sched.add_request(bad)
    run()
    after = copy.deepcopy(_good()[1])
    after.rid = "after"
    sched.add_request(after)
    run()
    return results


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "no-overlap"])
def overlap(request) -> bool:
    return request.param


@pytest.fixture(scope="module")
def reference(tiny_qwen3, overlap) -> dict[str, dict]:
    return _serve(_scheduler(tiny_qwen3, overlap), None)


def _fail_launch_when(sched, failing) -> None:
    launch = sched.runner.launch

    def launch_or_fail(batch):
        if failing(batch):
            raise RuntimeError(f"injected failure in {SECRET}")
        return launch(batch)

    sched.runner.launch = launch_or_fail


def _in_batch(batch, mode: ForwardMode, min_outputs: int = 0) -> bool:
    return batch.mode is mode and any(
        r.rid == "bad" and len(r.output_ids) >= min_outputs for r in batch.reqs
    )


def _fail_recording(sched) -> None:
    check = sched.stop_checker.check

    def check_or_fail(req):
        if req.rid == "bad" and len(req.output_ids) >= 3:
            raise RuntimeError(f"injected failure in {SECRET}")
        return check(req)

    sched.stop_checker.check = check_or_fail


INJECTIONS = {
    # Its prefill fails to launch: a batch of its own (the others decode).
    "prefill": lambda s: _fail_launch_when(s, lambda b: _in_batch(b, ForwardMode.EXTEND)),
    # A decode of every running request fails: relaunched one at a time, only "bad" fails.
    "decode": lambda s: _fail_launch_when(s, lambda b: _in_batch(b, ForwardMode.DECODE, 2)),
    # Recording its third token fails (in the stop check).
    "recording": _fail_recording,
}


@pytest.mark.parametrize("where", [*INJECTIONS, "queuing"])
def test_a_failing_request_fails_alone_and_every_kv_slot_comes_back(
    tiny_qwen3, overlap, reference, where
):
    sched = _scheduler(tiny_qwen3, overlap)
    free_slots, free_rows = sched.kv.free_slots(), sched.kv.req_to_token.available()
    bad = _bad()
    if where == "queuing":
        bad.input_ids = None  # reading it fails in add_request
    else:
        INJECTIONS[where](sched)
    results = _serve(sched, bad)

    reason = results["bad"]["finish"]
    assert reason["type"] == "error"
    assert "Traceback" not in reason["message"] and SECRET not in reason["message"]
    if where != "queuing":
        assert "injected failure" in reason["message"]
    for rid in ("good-0", "good-1", "good-2", "after"):
        assert results[rid] == reference[rid], rid
    assert sched.kv.free_slots() == free_slots and sched.kv.is_whole()
    assert sched.kv.req_to_token.available() == free_rows
    assert not sched.has_work() and sched.chunked is None


class _Tokenizer:
    """Decodes ids to letters; id 13 can't be decoded."""

    def decode(self, ids: list[int], **kwargs) -> str:
        if 13 in ids:
            raise ValueError(f"cannot decode 13 (in {SECRET})")
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_detokenizer_fails_the_request_it_cannot_decode_alone():
    detok = Detokenizer(_Tokenizer())
    bad = ReqOutput("bad", [13], None, prompt_tokens=1, completion_tokens=1, cached_tokens=0,
                    weight_version="v")  # fmt: skip
    good = ReqOutput("good", [1, 2], None, prompt_tokens=1, completion_tokens=2, cached_tokens=0,
                     weight_version="v")  # fmt: skip
    for out in (bad, good):
        detok.process_or_fail(out)
    assert (
        bad.finish_reason["type"] == "error" and "cannot decode 13" in bad.finish_reason["message"]
    )
    assert SECRET not in bad.finish_reason["message"] and "bad" not in detok.states
    assert good.finish_reason is None and good.text == "bc"


# ---- through the engine's processes ---------------------------------------------------------


def test_engine_fails_the_request_alone_and_serves_on(tiny_qwen3, monkeypatch):
    # A token id past the vocabulary that validation lets through (as a validation bug would):
    # computing its logprob raises in the scheduler.
    monkeypatch.setattr("rollout.engine.tokenizer_manager.validate_for_model", lambda *a: None)
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with RolloutEngine(tiny_qwen3, device="cpu", dtype="float32") as engine:
        before = engine.generate("a normal request", greedy)["output_ids"]

        async def together() -> list:
            bad = engine.async_generate(
                input_ids=[5, 6, 7], sampling_params=greedy, return_logprob=True,
                token_ids_logprob=[10**6],
            )  # fmt: skip
            good = [engine.async_generate(f"request {i}", greedy) for i in range(3)]
            return await asyncio.gather(bad, *good, return_exceptions=True)

        bad, *good = asyncio.run(together())
        assert isinstance(bad, RequestFailedError), bad
        assert "Traceback" not in str(bad) and ".py" not in str(bad)
        assert all(g["meta_info"]["finish_reason"]["type"] == "length" for g in good)
        assert engine.is_alive()
        assert engine.generate("a normal request", greedy)["output_ids"] == before
        assert engine.get_server_info()["kv_whole"]


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _assert_short(error: BaseException) -> None:
    text = str(error)
    assert "Traceback" not in text and 'File "' not in text and ".py" not in text, text
    assert len(text) < 400, text


def test_killed_scheduler_marks_the_engine_dead_at_once(tiny_qwen3, caplog):
    caplog.set_level(logging.ERROR, logger="rollout.engine.tokenizer_manager")
    with RolloutEngine(tiny_qwen3, device="cpu") as engine:
        os.kill(engine._procs[0].pid, signal.SIGKILL)
        assert _wait(lambda: not engine.is_alive(), 2)
        with pytest.raises(EngineDeadError) as dead:
            engine.generate("hello", {"max_new_tokens": 4})
        _assert_short(dead.value)
        assert _wait(
            lambda: any("exited unexpectedly" in r.getMessage() for r in caplog.records), 3
        )


def test_crashed_scheduler_logs_its_traceback_and_callers_get_a_short_error(tiny_qwen3, caplog):
    caplog.set_level(logging.ERROR, logger="rollout.engine.tokenizer_manager")
    with RolloutEngine(tiny_qwen3, device="cpu") as engine:
        # A message the scheduler can't handle: its loop raises, which ends the process.
        async def send_junk() -> None:
            await engine._tm.send.send_pyobj(("not", "a", "message"))

        engine._call(send_junk())
        assert _wait(lambda: not engine.is_alive(), 5)
        with pytest.raises(EngineDeadError) as dead:
            engine.generate("hello", {"max_new_tokens": 4})
        _assert_short(dead.value)
        assert "TypeError" in str(dead.value)
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "Traceback" in logged and "scheduler got an unknown message" in logged
