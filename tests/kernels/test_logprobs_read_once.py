"""Logprobs read once (LogprobHead.read_once, on GPUs with the Triton kernels): each row's
logsumexp and the returned entries' logits give the logprobs the [R, V] log-softmax gives,
for sampled and prompt tokens, the top-k and named ids; a step with a request whose sampling
changes its logits in place reads the log-softmax."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("triton")

import rollout_kernels.row_logsumexp as lse_kernel  # noqa: E402
from rollout.config import EngineOptions  # noqa: E402
from rollout.engine.messages import TokenizedRequest  # noqa: E402
from rollout.engine.sampling_params import SamplingParams  # noqa: E402
from rollout.engine.scheduler_process import SchedulerProcess  # noqa: E402


def _req(rid: str, ids: list[int], seed: int, **params) -> TokenizedRequest:
    sampling = SamplingParams(max_new_tokens=5, ignore_eos=True, **params)
    return TokenizedRequest(
        rid, ids, sampling, seed=seed, return_logprob=True, logprob_start_len=1,
        top_logprobs_num=3, token_ids_logprob=[5, 9],
    )  # fmt: skip


PLAIN = [
    _req("greedy", [5, 9, 2, 7, 1, 3], 1, temperature=0.0),
    _req("sampled", [8, 8, 1, 4], 2, temperature=1.0),
    _req("top-p", [3, 1, 4, 1, 5, 9, 2], 3, temperature=0.8, top_p=0.9),
]
PENALIZED = _req("penalized", [2, 7, 1, 8], 4, temperature=1.0, repetition_penalty=1.3)


def _run(model: str, reqs: list[TokenizedRequest], read_once: bool, device: str) -> dict[str, dict]:
    opts = EngineOptions.from_kwargs(model_path=model, device=device, dtype="float32", max_total_tokens=4096)
    sched = SchedulerProcess(opts).scheduler
    sched.runner.logprob_head.read_once = read_once
    for treq in reqs:
        sched.add_request(copy.deepcopy(treq))
    results: dict[str, dict] = {}
    while sched.has_work():
        for req in sched.step():
            out = sched.make_output(req)
            acc = results.setdefault(out.rid, {"ids": []})
            acc["ids"] += out.new_ids
            for key, values in (out.logprobs.entries() if out.logprobs else {}).items():
                acc.setdefault(key, []).extend(values)
    return results


def _assert_close(got, want, path="") -> None:
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=2e-5), path
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_close(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


def test_read_once_gives_the_log_softmax_logprobs(tiny_qwen3, monkeypatch, device):
    calls = []
    plain_lse = lse_kernel.row_logsumexp
    monkeypatch.setattr(lse_kernel, "row_logsumexp", lambda x, **kw: calls.append(len(x)) or plain_lse(x, **kw))
    want = _run(tiny_qwen3, PLAIN, read_once=False, device=device)
    assert calls == []
    got = _run(tiny_qwen3, PLAIN, read_once=True, device=device)
    assert calls  # the read-once path ran
    assert {rid: r["ids"] for rid, r in got.items()} == {rid: r["ids"] for rid, r in want.items()}
    for rid, result in want.items():
        assert set(got[rid]) == set(result)
        for key, values in result.items():
            _assert_close(got[rid][key], values, f"{rid}.{key}")


def test_a_request_that_changes_its_logits_is_read_from_the_log_softmax(tiny_qwen3, monkeypatch, device):
    calls = []
    plain_lse = lse_kernel.row_logsumexp
    monkeypatch.setattr(lse_kernel, "row_logsumexp", lambda x, **kw: calls.append(len(x)) or plain_lse(x, **kw))
    want = _run(tiny_qwen3, [PENALIZED], read_once=False, device=device)
    got = _run(tiny_qwen3, [PENALIZED], read_once=True, device=device)
    assert calls == []  # every step of it had the penalized request's rows
    assert got == want
