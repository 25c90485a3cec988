"""Sessions, token in / token out: each turn continues an earlier turn's exact ids and KV, a
multi-turn rollout comes back as one aligned trajectory, and bad session use is refused with
a clear error and no KV left behind. One engine per module (CPU, float32, tiny model)."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from server_helpers import start_server, stop_server

from rollout import RolloutEngine
from rollout.client import RolloutClient
from rollout.errors import InvalidRequest
from rollout.trajectory import SessionRollout, Trajectory, output_versions, run_turns

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
FLOAT32_TOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_qwen2):
    with RolloutEngine(tiny_qwen2, dtype="float32", device="cpu", max_total_tokens=1024) as eng:
        yield eng


def _ids(seed: int, n: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _assert_pool_whole(engine) -> None:
    """Nothing runs, nothing is locked: every cached slot is evictable, and a flush frees all."""
    info = engine.get_server_info()
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["kv_whole"] and info["kv_evictable"] == info["kv_cached"], info
    assert engine.flush_cache()["success"]
    info = engine.get_server_info()
    assert info["kv_free"] == info["kv_total"], info


def _logprobs(result: dict) -> list[float]:
    return [e[0] for e in result["meta_info"]["output_token_logprobs"]]


def test_five_turns_equal_one_uncached_run_and_reuse_the_prefix(engine):
    """Each turn's output equals a fresh, uncached run over every id so far; each turn found
    everything before it in the cache (all but the newest token, which has no KV)."""
    turns = [_ids(1, 16)] + [_ids(10 + k, 5) for k in range(4)]  # a prompt, then tool ids
    with SessionRollout(engine) as rollout:
        results = [rollout.turn(new, GREEDY) for new in turns]
        trajectory = rollout.trajectory
    sequences, seen = [], []
    for k, (new, result) in enumerate(zip(turns, results)):
        meta = result["meta_info"]
        assert meta["prompt_tokens"] == len(seen) + len(new)
        assert meta["cached_tokens"] == (len(seen) - 1 if k else 0)
        sequences.append(seen + new)
        seen = seen + new + result["output_ids"]
    for sequence, result in zip(sequences, results):
        assert engine.flush_cache()["success"]
        fresh = engine.generate(input_ids=sequence, sampling_params=GREEDY, return_logprob=True)
        assert fresh["meta_info"]["cached_tokens"] == 0
        assert fresh["output_ids"] == result["output_ids"]
        assert fresh["meta_info"]["prompt_tokens"] == result["meta_info"]["prompt_tokens"]
        for a, b in zip(_logprobs(fresh), _logprobs(result)):
            assert abs(a - b) < FLOAT32_TOL
    assert trajectory.token_ids == seen
    _assert_pool_whole(engine)


def test_trajectory_mask_logprobs_and_versions_line_up_with_the_ids(engine):
    """Mask 1 exactly on the sampled ids; their logprobs are those a prefill over the whole
    trajectory gives each of them (so nothing shifted), and each carries the weight version."""
    sampled = {"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True, "seed": 7}
    with SessionRollout(engine) as rollout:
        outputs = [rollout.turn(_ids(20 + k, 4 + k), sampled)["output_ids"] for k in range(5)]
        t = rollout.trajectory
    assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.weight_versions)
    expected_mask = []
    for k, out in enumerate(outputs):
        expected_mask += [0] * (4 + k) + [1] * len(out)
    assert t.loss_mask == expected_mask
    assert t.policy_ids == [tok for out in outputs for tok in out]
    version = engine.get_weight_version()
    assert [v for v, m in zip(t.weight_versions, t.loss_mask) if m] == [version] * sum(t.loss_mask)
    assert all(v is None and lp == 0.0 for v, lp, m in zip(t.weight_versions, t.logprobs, t.loss_mask) if not m)
    prefill = engine.generate(
        input_ids=t.token_ids, sampling_params={"max_new_tokens": 0},
        return_logprob=True, logprob_start_len=0,
    )  # fmt: skip
    scored = prefill["meta_info"]["input_token_logprobs"]
    for pos, (mask, logprob) in enumerate(zip(t.loss_mask, t.logprobs)):
        if mask:
            assert scored[pos][1] == t.token_ids[pos]
            assert abs(scored[pos][0] - logprob) < FLOAT32_TOL, pos
    _assert_pool_whole(engine)


def test_a_session_keeps_its_kv_while_other_requests_fill_the_pool(engine):
    first = _ids(30, 40)
    lone = _ids(31, 40)  # no session: the flood evicts it
    with SessionRollout(engine) as rollout:
        rollout.turn(first, GREEDY)
        engine.generate(input_ids=lone, sampling_params=GREEDY)
        for batch in range(6):  # 6 x 4 x 50 tokens: more than the pool's 1024
            flood = [_ids(100 + 4 * batch + i, 50) for i in range(4)]
            engine.generate(input_ids=flood, sampling_params={"max_new_tokens": 1})
        again = engine.generate(input_ids=lone, sampling_params=GREEDY)
        assert again["meta_info"]["cached_tokens"] == 0
        second = rollout.turn(_ids(32, 3), GREEDY)
        assert second["meta_info"]["cached_tokens"] == len(first) + GREEDY["max_new_tokens"] - 1
    _assert_pool_whole(engine)


def test_server_info_counts_open_sessions_and_the_kv_they_keep(engine):
    def counts() -> tuple[int, int, int]:
        info = engine.get_server_info()
        return info["open_sessions"], info["sessions_with_pinned_kv"], info["kv_pinned_by_sessions"]

    assert counts() == (0, 0, 0)
    kept = 12 + GREEDY["max_new_tokens"] - 1  # a finished turn's KV: all but its newest token
    first, second = SessionRollout(engine), SessionRollout(engine)
    assert counts() == (2, 0, 0)  # open, nothing kept yet
    first.turn(_ids(40, 12), GREEDY)
    second.turn(_ids(41, 12), GREEDY)
    assert counts() == (2, 2, 2 * kept)
    first.turn(_ids(42, 3), GREEDY)  # the second turn extends the path the first one kept
    assert counts() == (2, 2, 2 * kept + 3 + GREEDY["max_new_tokens"])
    first.close()
    assert counts() == (1, 1, kept)
    second.close()
    assert counts() == (0, 0, 0)
    _assert_pool_whole(engine)


def test_offset_and_replace_branch_a_session(engine):
    sid = engine.open_session(1000)
    try:
        engine.generate(input_ids=_ids(40, 8), sampling_params=GREEDY, session_params={"id": sid}, rid="a")
        b = engine.generate(input_ids=_ids(41, 3), sampling_params=GREEDY, session_params={"id": sid, "rid": "a"}, rid="b")
        assert b["meta_info"]["prompt_tokens"] == 8 + 6 + 3
        # offset 8: a's prompt only (its output dropped), then the new ids.
        c = engine.generate(
            input_ids=_ids(42, 2), sampling_params=GREEDY, rid="c",
            session_params={"id": sid, "rid": "a", "offset": 8},
        )  # fmt: skip
        assert c["meta_info"]["prompt_tokens"] == 8 + 2
        assert c["meta_info"]["cached_tokens"] == 8
        fresh = engine.generate(input_ids=_ids(40, 8) + _ids(42, 2), sampling_params=GREEDY)
        assert fresh["output_ids"] == c["output_ids"]
        # replace: the turns that continued a (b and c) are forgotten.
        engine.generate(
            input_ids=_ids(43, 2), sampling_params=GREEDY, rid="d",
            session_params={"id": sid, "rid": "a", "replace": True},
        )  # fmt: skip
        with pytest.raises(InvalidRequest, match="has no turn 'b'"):
            engine.generate(input_ids=[5], session_params={"id": sid, "rid": "b"})
        # The ids of a prompt given as text are appended as they are.
        text = engine.generate(prompt="hello there", sampling_params=GREEDY, session_params={"id": sid, "rid": "d"})
        assert text["meta_info"]["prompt_tokens"] == 8 + 6 + 2 + 6 + len(engine.tokenizer.encode("hello there"))
    finally:
        engine.close_session(sid)
    _assert_pool_whole(engine)


@pytest.mark.parametrize(
    "session_params, match",
    [
        ({"id": "nobody"}, "session 'nobody' is not open"),
        ({"id": "S", "rid": "missing"}, "has no turn 'missing'"),
        ({"id": "S", "rid": "t1", "offset": 999}, r"offset must be in \[0, 14\]"),
        ({"id": "S", "rid": "t1", "offset": -1}, "offset must be an int >= 0"),
        ({"id": "S", "rid": "t1", "colour": 1}, "unknown keys"),
        ({"rid": "t1"}, "needs an id"),
        ({"id": None, "rid": "t1"}, "needs an id"),
        ([{"id": "S"}, {"id": "S"}], "session_params has 2 entries for 1 samples"),
    ],
)
def test_bad_session_params_are_refused_clearly(engine, session_params, match):
    sid = engine.open_session(1000, session_id="S")
    try:
        engine.generate(input_ids=_ids(50, 8), sampling_params=GREEDY, session_params={"id": sid}, rid="t1")
        with pytest.raises((InvalidRequest, TypeError), match=match):
            engine.generate(input_ids=[5, 6], sampling_params=GREEDY, session_params=session_params)
        assert engine.generate(input_ids=[5, 6], sampling_params=GREEDY, session_params={"id": sid, "rid": "t1"})
    finally:
        engine.close_session(sid)
    _assert_pool_whole(engine)


def test_bad_session_calls_are_refused_clearly(engine):
    sid = engine.open_session(20, session_id="small")
    try:
        with pytest.raises(InvalidRequest, match="session 'small' is already open"):
            engine.open_session(100, session_id="small")
        with pytest.raises(InvalidRequest, match="capacity_of_str_len must be an int >= 1"):
            engine.open_session(0)
        with pytest.raises(InvalidRequest, match="session_id is not valid Unicode"):
            engine.open_session(100, session_id="s\ud800")  # JSON's lone "\ud800": no answer holds it
        with pytest.raises(InvalidRequest, match="is not open"):
            engine.close_session("s\ud800")
        with pytest.raises(InvalidRequest, match="session_id must not contain control characters, got U.000A at position 1"):
            engine.open_session(100, session_id="s\nINFO forged log line")
        engine.generate(input_ids=_ids(60, 10), sampling_params=GREEDY, session_params={"id": sid}, rid="x")
        with pytest.raises(InvalidRequest, match="rid 'x' is already a turn"):
            engine.generate(input_ids=[5], sampling_params=GREEDY, session_params={"id": sid}, rid="x")
        with pytest.raises(InvalidRequest, match=r"21 tokens, more than session 'small'.s capacity"):
            engine.generate(input_ids=[5] * 5, session_params={"id": sid, "rid": "x"})
        with pytest.raises(InvalidRequest, match="n=1"):
            engine.generate(input_ids=[5], sampling_params={"n": 2}, session_params={"id": sid, "rid": "x"})
    finally:
        engine.close_session(sid)
    with pytest.raises(InvalidRequest, match="session 'small' is not open"):
        engine.close_session(sid)
    with pytest.raises(InvalidRequest, match="session 'small' is not open"):
        engine.generate(input_ids=[5], session_params={"id": sid, "rid": "x"})
    _assert_pool_whole(engine)


def test_a_refused_replace_forgets_nothing(engine):
    """A replacing turn refused for its length (the session's ids and its own past the context)
    leaves the turns it would have replaced."""
    sid = engine.open_session(100_000)
    try:
        engine.generate(input_ids=_ids(65, 8), sampling_params=GREEDY, session_params={"id": sid}, rid="r0")
        engine.generate(input_ids=[5], sampling_params=GREEDY, session_params={"id": sid, "rid": "r0"}, rid="r1")
        too_long = [5] * (engine.info["context_length"] - 8)
        with pytest.raises(InvalidRequest, match="leaves no room in the context"):
            engine.generate(input_ids=too_long, session_params={"id": sid, "rid": "r0", "replace": True})
        after = engine.generate(input_ids=[6], sampling_params=GREEDY, session_params={"id": sid, "rid": "r1"})
        assert after["meta_info"]["prompt_tokens"] == 8 + 6 + 1 + 6 + 1
    finally:
        engine.close_session(sid)
    _assert_pool_whole(engine)


def test_a_running_turn_cant_be_continued_and_closing_aborts_it(engine):
    sid = engine.open_session(100_000)
    long = {"max_new_tokens": 400, "ignore_eos": True}

    async def run():
        stream = await engine.async_generate(
            input_ids=_ids(70, 5), sampling_params=long, stream=True, rid="busy",
            session_params={"id": sid},
        )  # fmt: skip
        first = await stream.__anext__()
        with pytest.raises(InvalidRequest, match="turn 'busy' of session .* is still running"):
            await engine.async_generate(input_ids=[5], session_params={"id": sid, "rid": "busy"})
        await asyncio.get_running_loop().run_in_executor(None, engine.close_session, sid)
        last = first
        async for out in stream:
            last = out
        return last

    last = asyncio.run(run())
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < long["max_new_tokens"]
    _assert_pool_whole(engine)


def test_a_flush_unpins_and_later_turns_recompute(engine):
    with SessionRollout(engine) as rollout:
        rollout.turn(_ids(80, 12), GREEDY)
        assert engine.flush_cache()["success"]
        assert engine.get_server_info()["kv_cached"] == 0
        second = rollout.turn(_ids(81, 2), GREEDY)
        assert second["meta_info"]["cached_tokens"] == 0
        fresh_ids = rollout.trajectory.token_ids[: -len(second["output_ids"])]
    fresh = engine.generate(input_ids=fresh_ids, sampling_params=GREEDY)
    assert fresh["output_ids"] == second["output_ids"]
    _assert_pool_whole(engine)


def test_run_turns_steps_many_sessions_in_one_call(engine):
    rollouts = [SessionRollout(engine) for _ in range(3)]
    try:
        params = [GREEDY] * 3
        run_turns(engine, rollouts, [_ids(90 + i, 6) for i in range(3)], params)
        out = run_turns(engine, rollouts, [_ids(95 + i, 2) for i in range(3)], params)
        assert [o["meta_info"]["cached_tokens"] for o in out] == [6 + 6 - 1] * 3
        assert all(len(r.trajectory) == 6 + 6 + 2 + 6 for r in rollouts)
        with pytest.raises(ValueError, match="one of each per rollout"):
            run_turns(engine, rollouts, [[5]], params)
        with pytest.raises(ValueError, match="rollout 0 is given twice"):
            run_turns(engine, [rollouts[0], rollouts[0]], [[5], [6]], [GREEDY] * 2)
        assert len(rollouts[0].trajectory) == 6 + 6 + 2 + 6
        rollouts[0].turn([7], GREEDY)  # still continues its last turn
    finally:
        for r in rollouts:
            r.close()
    _assert_pool_whole(engine)


def test_a_request_needing_the_kv_sessions_keep_takes_it_instead_of_waiting(engine):
    """Sessions pin up to half the pool; a request that fits the pool but not what the pins
    leave gets the KV of the sessions used least recently (their next turns recompute it)
    instead of waiting forever, and the others keep theirs."""
    rollouts = [SessionRollout(engine) for _ in range(5)]
    try:
        run_turns(engine, rollouts, [_ids(300 + i, 100) for i in range(5)], [GREEDY] * 5)
        rollouts[0].turn(_ids(320, 2), GREEDY)  # now the most recently used
        info = engine.get_server_info()
        assert info["kv_pinned_by_sessions"] > 1024 - 700, info
        pinned = info["sessions_with_pinned_kv"]

        async def big():
            request = engine.async_generate(input_ids=_ids(310, 700), sampling_params=GREEDY)
            return await asyncio.wait_for(request, 60)

        assert asyncio.run(big())["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
        info = engine.get_server_info()
        assert 0 < info["sessions_with_pinned_kv"] < pinned, info
        kept = rollouts[0].turn(_ids(311, 2), GREEDY)["meta_info"]
        assert kept["prompt_tokens"] == 100 + 6 + 2 + 6 + 2
        assert kept["cached_tokens"] == 100 + 6 + 2 + 6 - 1  # its KV was kept
        lost = rollouts[1].turn(_ids(312, 2), GREEDY)["meta_info"]  # used least recently
        assert lost["prompt_tokens"] == 100 + 6 + 2 and lost["cached_tokens"] < 100 + 6 - 1
    finally:
        for r in rollouts:
            r.close()
    _assert_pool_whole(engine)


def test_output_versions_follow_mid_request_updates():
    meta = {"weight_version": "v2", "weight_version_changes": [{"offset": 2, "weight_version": "v2"}]}
    assert output_versions(meta, 4) == [None, None, "v2", "v2"]
    assert output_versions({"weight_version": "v1"}, 2) == ["v1", "v1"]
    # The engine's spans name the version that sampled the tokens before the update too.
    spans = [{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 4}]
    assert output_versions({**meta, "weight_versions": spans}, 4) == ["v1", "v1", "v2", "v2"]
    t = Trajectory()
    with pytest.raises(ValueError, match="return_logprob=True"):
        t.add_output({"output_ids": [1], "meta_info": {"weight_version": "v"}})
    with pytest.raises(ValueError, match="not those of its output ids"):
        t.add_output({"output_ids": [1], "meta_info": {"weight_version": "v", "output_token_logprobs": [(-1.0, 2, None)]}})


def test_sessions_over_http_match_the_engine(tiny_qwen2):
    server, url = start_server(tiny_qwen2)
    try:
        with RolloutClient(url) as client:
            sid = httpx.post(f"{url}/open_session", json={"capacity_of_str_len": 500}).json()
            assert isinstance(sid, str) and sid
            assert httpx.post(f"{url}/close_session", json={"session_id": sid}).status_code == 200
            bad = httpx.post(f"{url}/close_session", json={"session_id": sid})
            assert bad.status_code == 400 and "is not open" in bad.json()["error"]["message"]
            for capacity in (True, 10.0, "10"):  # the engine's open_session refuses them too
                bad = httpx.post(f"{url}/open_session", json={"capacity_of_str_len": capacity})
                assert bad.status_code == 400 and "capacity_of_str_len" in bad.json()["error"]["message"]
            bad = httpx.post(f"{url}/generate", json={"input_ids": [5], "session_params": {"id": None}})
            assert bad.status_code == 400 and "needs an id" in bad.json()["error"]["message"]
            with SessionRollout(client) as rollout:
                first = rollout.turn(_ids(1, 16), GREEDY)
                second = rollout.turn(_ids(10, 5), GREEDY)
                trajectory = rollout.trajectory
            assert second["meta_info"]["cached_tokens"] == 16 + 6 - 1
            assert trajectory.loss_mask == [0] * 16 + [1] * 6 + [0] * 5 + [1] * 6
            assert trajectory.policy_ids == first["output_ids"] + second["output_ids"]
            with pytest.raises(ValueError, match="is not open"):
                client.generate(input_ids=[5], session_params={"id": rollout.session_id})
            with pytest.raises(ValueError, match="is not open"):
                client.close_session(rollout.session_id)
            client.abort_request(rid="nobody")  # still the plain abort body
    finally:
        stop_server(server)
