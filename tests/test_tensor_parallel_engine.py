"""Tensor parallelism through the whole engine (CPU, gloo): rank 0 schedules, every rank runs
its shard, and the results are the one-rank engine's."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rollout import RolloutEngine
from rollout.engine.tokenizer_manager import EngineDeadError

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
SAMPLED = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 10, "seed": 7, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 70))]


def _engine(path: str, tp: int, **kw) -> RolloutEngine:
    return RolloutEngine(
        path, dtype="float32", device="cpu", max_total_tokens=2048, tp_size=tp, **kw
    )


def _run(engine: RolloutEngine) -> tuple[list[dict], list[dict]]:
    greedy = engine.generate(
        input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3
    )
    sampled = engine.generate(input_ids=PROMPTS, sampling_params={**SAMPLED, "n": 2})
    return greedy, sampled


@pytest.fixture(scope="module")
def one_rank(tiny_llama, tiny_qwen2, tiny_qwen3):
    results = {}
    for name, path in (("llama", tiny_llama), ("qwen2", tiny_qwen2), ("qwen3", tiny_qwen3)):
        with _engine(path, 1) as engine:
            results[name] = _run(engine)
    return results


def _assert_same(
    expected: tuple[list[dict], list[dict]], got: tuple[list[dict], list[dict]]
) -> None:
    for a, b in zip(expected[0], got[0]):
        assert a["output_ids"] == b["output_ids"]
        for (lp_a, id_a, _), (lp_b, id_b, _) in zip(
            a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        ):
            assert id_a == id_b and lp_a == pytest.approx(lp_b, abs=1e-5)
        tops_a = [[e[1] for e in top] for top in a["meta_info"]["output_top_logprobs"]]
        tops_b = [[e[1] for e in top] for top in b["meta_info"]["output_top_logprobs"]]
        assert tops_a == tops_b
    assert [o["output_ids"] for o in expected[1]] == [o["output_ids"] for o in got[1]]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_two_ranks_generate_what_one_rank_does(name, one_rank, request):
    path = request.getfixturevalue(f"tiny_{name}")
    with _engine(path, 2) as engine:
        got = _run(engine)
        info = engine.get_server_info()
    _assert_same(one_rank[name], got)
    assert info["tp_size"] == 2 and [r["rank"] for r in info["ranks"]] == [0, 1]
    # Each rank holds about half of the layers' weights (embeddings and norms aside).
    assert info["ranks"][0]["weights_bytes"] == info["ranks"][1]["weights_bytes"]


def test_four_ranks_replicate_the_kv_heads(one_rank, tiny_qwen3):
    # The tiny models have 4 query heads and 2 KV heads: at 4 ranks each KV head is on two ranks.
    with _engine(tiny_qwen3, 4) as engine:
        got = _run(engine)
    _assert_same(one_rank["qwen3"], got)


def test_a_killed_rank_stops_the_engine_cleanly(tiny_qwen3):
    engine = _engine(tiny_qwen3, 2)
    try:
        follower = next(p for p in engine._procs if p.name == "rollout-tp-rank-1")
        os.kill(follower.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while engine.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not engine.is_alive()
        assert "rollout-tp-rank-1 exited" in engine.dead_reason
        with pytest.raises((EngineDeadError, RuntimeError)):
            engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
    finally:
        started = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - started < 30
    assert not any(p.is_alive() for p in engine._procs)
