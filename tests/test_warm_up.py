"""The warm-up (run on GPUs before the engine reports ready) leaves nothing behind: the engine's
scheduler then serves exactly what an engine without it serves, with nothing cached, counted
or held."""

from __future__ import annotations

import pytest

from rollout.config import EngineOptions
from rollout.engine.messages import TokenizedRequest
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.scheduler_process import SchedulerProcess
from rollout.engine.warm_up import warm_up


def _process(model: str, **options) -> SchedulerProcess:
    opts = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096, **options}
    return SchedulerProcess(EngineOptions.from_kwargs(model_path=model, **opts))


def _serve(proc: SchedulerProcess) -> list[tuple[list[int], list[float]]]:
    sched = proc.scheduler
    prompts = [[5, 9, 2, 7, 1, 3], [5, 9, 2, 7, 4], [8, 8, 1]]
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.95, ignore_eos=True)
        sched.add_request(TokenizedRequest(f"r{i}", ids, params, seed=100 + i, return_logprob=True))
    outputs = {}
    while sched.has_work():
        for req in sched.step():
            if req.finished:
                out = sched.make_output(req)
                outputs[req.rid] = (list(req.output_ids), out)
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("overlap", [True, False])
def test_after_the_warm_up_the_engine_serves_as_one_without_it(tiny_qwen3, overlap):
    options = {"disable_overlap_schedule": not overlap}
    warmed, fresh = _process(tiny_qwen3, **options), _process(tiny_qwen3, **options)
    rows = warmed.runner.req_to_token.available()
    assert warm_up(warmed.options, warmed.runner, warmed.scheduler.stop_checker, rows=4) > 0
    assert warmed.runner.req_to_token.available() == rows  # every table row given back
    info, clean = warmed.scheduler.server_info(), fresh.scheduler.server_info()
    counted = ("kv_free", "kv_cached", "prompt_tokens", "generated_tokens", "num_running")
    assert {k: info[k] for k in counted} == {k: clean[k] for k in counted}
    got, want = _serve(warmed), _serve(fresh)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert [out.logprobs for _, out in got] == [out.logprobs for _, out in want]
    assert all(out.cached_tokens == 0 for _, out in got[:1])  # nothing of the warm-up cached


def test_an_embedding_model_warms_up_on_embed_requests(tiny_qwen2):
    proc = _process(tiny_qwen2, is_embedding=True)
    rows = proc.runner.req_to_token.available()
    assert warm_up(proc.options, proc.runner, proc.scheduler.stop_checker, rows=3) == 3
    assert proc.runner.req_to_token.available() == rows


def test_the_warm_up_runs_the_lm_head_at_each_small_batch_kernel_variant(tiny_qwen3, monkeypatch):
    # The small-batch GEMM kernel (the LM head of up to 16 rows on a GPU) has a variant for one
    # row, for 16 and for any other count: serving must find each of them built.
    from rollout.models import vocab_parallel

    rows, plain = [], vocab_parallel.logits_linear

    def recording(hidden, *args, **kwargs):
        rows.append(hidden.shape[0])
        return plain(hidden, *args, **kwargs)

    monkeypatch.setattr(vocab_parallel, "logits_linear", recording)
    proc = _process(tiny_qwen3)
    warm_up(proc.options, proc.runner, proc.scheduler.stop_checker)
    assert {1, 16} <= set(rows) and any(1 < n < 16 for n in rows), sorted(set(rows))


def test_a_short_context_limits_the_warm_up_prompts(tiny_qwen3, caplog):
    # Every prompt and its 2 new tokens fit the context: none is refused or cut short.
    proc = _process(tiny_qwen3, context_length=40)
    assert warm_up(proc.options, proc.runner, proc.scheduler.stop_checker, rows=2) > 0
    assert "warm-up request" not in caplog.text
    short = _process(tiny_qwen3, context_length=20)
    assert warm_up(short.options, short.runner, short.scheduler.stop_checker) == 0


def test_a_failed_warm_up_is_logged_and_the_engine_serves_without_it(tiny_qwen3, caplog, monkeypatch):
    from rollout.engine.scheduler import Scheduler

    proc, fresh = _process(tiny_qwen3), _process(tiny_qwen3)
    # Steps that fail fail their requests (logged), and the warm-up goes on to its end.
    monkeypatch.setattr(proc.runner, "launch", _failing)
    proc.warm_up()
    assert "warm-up request" in caplog.text and "RuntimeError: the device went away" in caplog.text
    assert "warmup_s" in proc.info
    monkeypatch.undo()
    # A warm-up that raises is skipped.
    del proc.info["warmup_s"]
    monkeypatch.setattr(Scheduler, "flush_cache", _failing)
    proc.warm_up()
    assert "the warm-up failed; serving without it" in caplog.text and "warmup_s" not in proc.info
    monkeypatch.undo()
    assert [ids for ids, _ in _serve(proc)] == [ids for ids, _ in _serve(fresh)]


def _failing(*args, **kwargs):
    raise RuntimeError("the device went away")


def test_with_the_fused_all_reduce_the_warm_up_prefills_past_the_fused_kernels_rows(
    tiny_qwen3, monkeypatch
):
    # A step of more rows than FlashInfer's fused all-reduce takes runs the all-reduce and
    # the norm apart (a kernel variant of its own): the warm-up runs one such prefill.
    import dataclasses

    from rollout.forward.all_reduce_norm import FUSED_MAX_TOKENS

    proc = _process(tiny_qwen3, max_total_tokens=3 * FUSED_MAX_TOKENS)
    rows, run_model = [], proc.runner._run_model

    def recording(fb):
        rows.append(fb.input_ids.shape[0])
        return run_model(fb)

    monkeypatch.setattr(proc.runner, "_run_model", recording)
    warm_up(proc.options, proc.runner, proc.scheduler.stop_checker, rows=2)
    assert max(rows) <= FUSED_MAX_TOKENS  # without the fusion, no such prefill
    rows.clear()
    fused = dataclasses.replace(proc.runner.kernel_plan, allreduce_fusion=True)
    monkeypatch.setattr(proc.runner, "kernel_plan", fused)
    warm_up(proc.options, proc.runner, proc.scheduler.stop_checker, rows=2)
    assert max(rows) > FUSED_MAX_TOKENS
    assert proc.scheduler.kv.is_whole()
