"""The pool's routing and request splitting, without Ray or engines: prefix affinity, least
load, pinning by rid, and splitting a batch per prompt with the answers back in order."""

from __future__ import annotations

import pytest

from rollout.generate_request import GenerateRequest
from rollout.pool.requests import join, mark_retried, split
from rollout.pool.router import Router

PROMPT = list(range(100, 164))  # 64 tokens: 4 blocks of 16


def test_a_group_sent_one_by_one_lands_on_one_replica_and_counts_prefix_hits():
    router = Router(3)
    first = router.route(PROMPT, {0, 1, 2})
    assert first.reason == "least_load"
    router.started(first.replica, 100)  # still running: the others are less loaded now
    for _ in range(7):
        route = router.route(PROMPT, {0, 1, 2})
        assert (route.replica, route.reason, route.matched_tokens) == (first.replica, "prefix", 64)
    stats = router.stats()[first.replica]
    assert (
        stats["routed"] == 8 and stats["prefix_hits"] == 7 and stats["prefix_hit_tokens"] == 7 * 64
    )
    assert stats["prefix_hit_rate"] == pytest.approx(7 / 8)


def test_the_next_turn_of_a_conversation_follows_its_prefix():
    router = Router(2)
    router.started(1, 10_000)  # replica 1 busy: turn 1 goes to 0
    turn1 = router.route(PROMPT, {0, 1})
    assert turn1.replica == 0
    router.finished(1, 10_000)
    router.started(0, 500)  # now 0 is the busier one, but it holds the conversation
    turn2 = router.route(PROMPT + [7, 8, 9] * 10, {0, 1})
    assert (turn2.replica, turn2.reason, turn2.matched_tokens) == (0, "prefix", 64)


def test_unrelated_prompts_spread_by_load():
    router = Router(2)
    a = router.route([1] * 40, {0, 1})
    router.started(a.replica, 200)
    b = router.route([2] * 40, {0, 1})
    assert b.replica != a.replica and b.reason == "least_load"


def test_an_overloaded_prefix_owner_is_skipped():
    router = Router(2, max_imbalance_tokens=1000)
    owner = router.route(PROMPT, {0, 1}).replica
    router.started(owner, 5000)
    route = router.route(PROMPT, {0, 1})
    assert route.replica != owner and route.reason == "least_load"


def test_text_prompts_match_on_characters_and_ids_on_tokens():
    router = Router(2)
    text = "You are a helpful assistant. " * 8
    owner = router.route(text, {0, 1}).replica
    router.started(owner, 1000)
    route = router.route(text + "Tell me a joke.", {0, 1})
    assert route.replica == owner and route.reason == "prefix" and route.matched_tokens > 0


def test_a_rid_stays_pinned_and_a_down_replica_is_never_chosen():
    router = Router(2)
    router.started(0, 1000)
    pinned = router.route([5, 6], {0, 1}, rid="session-1")
    assert pinned.replica == 1
    router.finished(0, 1000)
    router.started(1, 5000)
    again = router.route([9, 9, 9], {0, 1}, rid="session-1")
    assert (again.replica, again.reason) == (1, "pinned")
    assert router.route([9, 9, 9], {0}, rid="session-1").replica == 0  # 1 is down
    with pytest.raises(ValueError, match="no replica is serving"):
        router.route(PROMPT, set())


def test_a_restarted_replica_loses_its_prefixes_and_pins():
    router = Router(2)
    owner = router.route(PROMPT, {0, 1}, rid="r").replica
    router.forget(owner)
    assert router.index.match(PROMPT, {0, 1}) == (None, 0)
    assert router.pinned_replica("r") is None


def test_an_open_sessions_pin_outlives_the_bound_on_rid_pins():
    router = Router(2, max_pins=2)
    router.pin("session/s", 1)
    for k in range(5):
        router.route([k], {0, 1}, rid=f"r{k}")
    assert router.pinned_replica("session/s") == 1
    assert router.route([9], {0, 1}, rid="session/s").replica == 1
    router.unpin("session/s")
    assert router.pinned_replica("session/s") is None


def test_the_prefix_index_is_bounded():
    router = Router(2, max_prefix_entries=10)
    for k in range(50):
        router.route([k] * 64, {0, 1})
    assert len(router.index) <= 10


def test_a_batch_splits_per_prompt_with_its_own_params_and_rid():
    request = GenerateRequest(
        input_ids=[[1, 2, 3], [4, 5]], sampling_params=[{"n": 4, "max_new_tokens": 8}, {}],
        rid=["a", "b"], return_logprob=True,
    )  # fmt: skip
    parts, joined = split(request)
    assert joined and len(parts) == 2
    assert parts[0].request.input_ids == [[1, 2, 3]] and parts[0].key == [1, 2, 3]
    assert parts[0].request.sampling_params == {"n": 4, "max_new_tokens": 8}
    assert parts[0].request.rid == ["a"] and parts[0].rid == "a"
    assert parts[0].request.return_logprob and parts[1].request.rid == ["b"]
    assert parts[0].tokens == (3 + 8) * 4 and parts[1].tokens == 2 + 128
    answers = [[{"id": "a0"}, {"id": "a1"}], [{"id": "b0"}]]
    assert [o["id"] for o in join(answers)] == ["a0", "a1", "b0"]


def test_single_prompts_and_ill_shaped_calls_are_not_split():
    for request in (
        GenerateRequest(prompt="hello", sampling_params={"n": 3}),
        GenerateRequest(input_ids=[1, 2, 3]),
        GenerateRequest(prompt=["a", "b"], sampling_params=[{}]),  # the engine's error
        GenerateRequest(prompt=["a", "b"], stream=True),
    ):
        parts, joined = split(request)
        assert not joined and parts[0].request is request
    assert split(GenerateRequest(prompt="hello"))[0][0].key == "hello"


def test_retried_answers_say_so():
    answer = [{"meta_info": {}}, {"meta_info": {}}]
    assert all(o["meta_info"]["retried"] for o in mark_retried(answer))
