"""enable_deterministic_inference: a request's tokens and logprobs are the same bits whatever
else is batched with it, with or without the prefix cache, chunked prefill (7 and 64 tokens a
step) or overlap scheduling, and in a fresh engine each time (issue 24).

The scheduler runs in-process on the tiny checkpoint in float32; the kernels run under Triton's
interpreter on the CPU, compiled on a GPU (with CUDA graphs there)."""

from __future__ import annotations

import copy
import gc
import random

import pytest
import torch

from rollout.config import EngineOptions
from rollout.engine.messages import TokenizedRequest
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.scheduler_process import SchedulerProcess
from rollout.forward.kernel_plan import resolve_kernel_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 800) for _ in range(n)]


def _req(rid: str, ids: list[int], seed: int, start: int = 0, **params) -> TokenizedRequest:
    """Returns logprobs (with the top 2) of its output and of its prompt from token `start`."""
    params = {"ignore_eos": True, "max_new_tokens": 5, **params}
    return TokenizedRequest(
        rid, ids, SamplingParams(**params), seed=seed, return_logprob=True,
        logprob_start_len=start, top_logprobs_num=2,
    )  # fmt: skip


# The requests checked: each is run alone, then in the batches below.
TARGETS = [
    # Prompt logprobs from token 11 on: its first 10 tokens may come from the prefix cache.
    _req("sampled", _ids(1, 13), 11, start=11, temperature=1.0),
    _req("greedy", _ids(2, 21), 12, temperature=0.0),
    # Filters of its own: alone a batch of one filter set, batched one set among several.
    _req("filtered", _ids(10, 9), 20, temperature=0.9, top_k=7, top_p=0.95),
]
# What they are batched with: other lengths, filters and penalties.
FILLERS = [
    _req("top-p", _ids(3, 4), 13, temperature=0.8, top_p=0.9),
    _req("top-k", _ids(4, 37), 14, temperature=1.2, top_k=5),
    _req("penalty", _ids(5, 9), 15, repetition_penalty=1.3, max_new_tokens=7),
    _req("long", _ids(6, 52), 16, temperature=1.0, max_new_tokens=3),
    _req("short", _ids(7, 2), 17, temperature=0.0, max_new_tokens=8),
    _req("min-p", _ids(8, 17), 18, temperature=1.0, min_p=0.1),
]
# A request that shares the sampled target's first 10 prompt tokens: run first, it leaves
# them in the prefix cache for the target.
PREFIX_WARMER = _req("warmer", TARGETS[0].input_ids[:10] + _ids(9, 6), 19, max_new_tokens=2)


def _drain(sched, results: dict[str, dict]) -> None:
    """Steps `sched` until idle, adding each request's outputs to results[rid]."""
    while sched.has_work():
        done = sched.step()
        for req in done + (sched.take_reports() if not sched.has_work() else []):
            out = sched.make_output(req)
            acc = results.setdefault(out.rid, {"ids": [], "cached": 0})
            acc["ids"] += out.new_ids
            acc["cached"] = max(acc["cached"], out.cached_tokens)
            for key, values in (out.logprobs.entries() if out.logprobs else {}).items():
                acc.setdefault(key, []).extend(values)


def _run(path: str, reqs: list[TokenizedRequest], first=(), **options) -> dict[str, dict]:
    """Runs `first` to completion, then `reqs` together, in a fresh in-process scheduler with
    deterministic inference. Returns each request's ids, logprobs and cached tokens."""
    opts = EngineOptions.from_kwargs(
        model_path=path, device=DEVICE, dtype="float32", max_total_tokens=2048,
        enable_deterministic_inference=True, **options,
    )  # fmt: skip
    sched = SchedulerProcess(opts).scheduler
    results: dict[str, dict] = {}
    for group in (first, reqs):
        for treq in group:
            sched.add_request(copy.deepcopy(treq))
        _drain(sched, results)
    # NOTE: freed here, not at some later collection: CUDA graphs destroyed while a later test
    # draws random numbers on the GPU can break its generator's state.
    del sched
    gc.collect()
    return results


def _what_must_match(result: dict) -> dict:
    return {key: value for key, value in result.items() if key != "cached"}


@pytest.fixture(scope="module")
def alone(tiny_qwen3) -> dict[str, dict]:
    """Each target run on its own, in its own engine."""
    return {t.rid: _run(tiny_qwen3, [t])[t.rid] for t in TARGETS}


SCENARIOS = {
    "batch of 8, overlap": ({}, False),
    "chunks of 7, eager": ({"chunked_prefill_size": 7, "disable_overlap_schedule": True}, False),
    "chunks of 64, prefix cached": ({"chunked_prefill_size": 64}, True),
    "no prefix cache, eager": (
        {"disable_radix_cache": True, "disable_overlap_schedule": True},
        False,
    ),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_request_gets_the_same_bits_in_any_batch(tiny_qwen3, alone, scenario):
    options, warm = SCENARIOS[scenario]
    reqs = FILLERS[:3] + [TARGETS[0]] + FILLERS[3:] + TARGETS[1:]
    got = _run(tiny_qwen3, reqs, first=[PREFIX_WARMER] if warm else (), **options)
    for target in TARGETS:
        result = got[target.rid]
        assert len(result["output_token_logprobs"]) == 5
        # Python floats from float32: == is bitwise equality of the logprobs.
        assert _what_must_match(result) == _what_must_match(alone[target.rid]), target.rid
    if warm:
        assert got["sampled"]["cached"] >= 10  # the prefix really came from the cache


def test_thirty_two_requests_at_once(tiny_qwen3, alone):
    # Two tokens each: the 32 rows share the targets' prefill and first decode step.
    many = [_req(f"f{i}", _ids(100 + i, 2 + i % 5), 200 + i, max_new_tokens=2) for i in range(30)]
    got = _run(tiny_qwen3, many[:15] + TARGETS + many[15:])
    for target in TARGETS:
        assert _what_must_match(got[target.rid]) == _what_must_match(alone[target.rid])


def test_the_plan_reports_the_mode_and_refuses_what_it_cannot_keep(tiny_qwen3):
    dev = torch.device(DEVICE)
    plan = resolve_kernel_plan(
        EngineOptions.from_kwargs(model_path=tiny_qwen3, deterministic_inference=True),
        dev, torch.float32,
    )  # fmt: skip
    assert plan.deterministic_inference and plan.as_dict()["deterministic_inference"] is True
    assert plan.attention_backend == plan.decode_backend == "deterministic"
    assert plan.decode_max_batch is None and plan.skinny_gemm_max_rows == 0
    assert plan.sampling_per_filter_set and "sampling kernel per filter set" in str(plan)
    assert plan.cuda_graphs == (DEVICE == "cuda")
    off = resolve_kernel_plan(EngineOptions.from_kwargs(model_path=tiny_qwen3), dev, torch.float32)
    assert not off.deterministic_inference
    for bad, named in (
        ({"attention_backend": "torch"}, "attention_backend"),
        ({"enable_lora": True}, "enable_lora"),
        ({"tp_size": 2, "tp_backend": "gloo"}, "tp_size"),
    ):
        options = EngineOptions.from_kwargs(
            model_path=tiny_qwen3, enable_deterministic_inference=True, **bad
        )
        with pytest.raises(ValueError, match=named):
            resolve_kernel_plan(options, dev, torch.float32)


def test_without_triton_the_mode_is_refused_by_name(tiny_qwen3, monkeypatch):
    from rollout.forward import kernel_plan

    real = kernel_plan.importlib.util.find_spec
    monkeypatch.setattr(
        kernel_plan.importlib.util, "find_spec", lambda name: None if name == "triton" else real(name)
    )
    options = EngineOptions.from_kwargs(model_path=tiny_qwen3, enable_deterministic_inference=True)
    with pytest.raises(ValueError, match="pip install triton"):
        resolve_kernel_plan(options, torch.device(DEVICE), torch.float32)


def test_the_server_flag_turns_the_mode_on():
    from rollout.server.launch import build_parser

    args = build_parser().parse_args(["--model-path", "m", "--enable-deterministic-inference"])
    assert args.enable_deterministic_inference is True
    assert build_parser().parse_args(["--model-path", "m"]).enable_deterministic_inference is False


def test_server_info_says_the_mode_is_on(tiny_qwen3):
    opts = EngineOptions.from_kwargs(
        model_path=tiny_qwen3, device=DEVICE, dtype="float32", max_total_tokens=256,
        enable_deterministic_inference=True,
    )  # fmt: skip
    info = SchedulerProcess(opts).info
    assert info["kernel_plan"]["deterministic_inference"] is True
    assert info["attention_backend"] == "deterministic"
