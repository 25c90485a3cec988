from __future__ import annotations

import random

import pytest
import torch

from rollout.engine.radix_cache import RadixCache, TreeNode
from rollout.forward.kv_pool import SlotAllocator

NUM_SLOTS = 64


def make(num_slots: int = NUM_SLOTS, disable: bool = False) -> tuple[SlotAllocator, RadixCache]:
    allocator = SlotAllocator(num_slots)
    return allocator, RadixCache(allocator, disable=disable)


def tree_slots(cache: RadixCache) -> list[int]:
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        out += node.value.tolist()
        stack.extend(node.children.values())
    return out


def pinned_slots(cache: RadixCache, locked: list[TreeNode]) -> int:
    """Slots of the nodes on the paths from `locked` (the nodes requests hold) to the root."""
    pinned: dict[int, TreeNode] = {}
    for node in locked:
        while node is not cache.root:
            pinned[id(node)] = node
            node = node.parent
    return sum(len(n.value) for n in pinned.values())


def check_whole(
    allocator: SlotAllocator, cache: RadixCache, live: int = 0, locked: list[TreeNode] = ()
) -> None:
    """The pool is whole: every slot is free, in the tree or `live` (a request's own); the tree
    holds what its sizes say, and exactly the paths of the `locked` nodes are protected."""
    assert allocator.available() + cache.total_size() + live == allocator.num_slots
    held = len(tree_slots(cache))
    protected = pinned_slots(cache, list(locked))
    assert cache.protected_size() == protected
    assert cache.evictable_size() == held - protected


def finish(allocator: SlotAllocator, cache: RadixCache, tokens: list[int]) -> torch.Tensor:
    """Runs one request over `tokens` from its cached prefix to the end and finishes it."""
    match = cache.match_prefix(tokens)
    cache.lock(match.node)
    own = allocator.allocate(len(tokens) - len(match.slots))
    slots = torch.cat([match.slots, own])
    cache.cache_finished(tokens, slots, match.node, len(match.slots))
    return slots


def test_match_full_partial_and_none() -> None:
    allocator, cache = make()
    slots = finish(allocator, cache, [1, 2, 3, 4, 5])
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == slots.tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == slots.tolist()
    partial = cache.match_prefix([1, 2, 3, 9])
    assert partial.slots.tolist() == slots[:3].tolist()
    assert partial.node.key == [1, 2, 3]  # split: the node ends where the match does
    assert list(partial.node.children) == [4]
    none = cache.match_prefix([7, 1, 2])
    assert none.slots.numel() == 0 and none.node is cache.root
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == slots.tolist()
    check_whole(allocator, cache)


def test_shared_prefixes() -> None:
    allocator, cache = make()
    a = finish(allocator, cache, [1, 2, 3, 4])
    b = finish(allocator, cache, [1, 2, 3, 7, 8])
    c = finish(allocator, cache, [1, 2, 9])
    assert b[:3].tolist() == a[:3].tolist() and c[:2].tolist() == a[:2].tolist()
    assert cache.total_size() == 4 + 2 + 1
    assert cache.match_prefix([1, 2, 3, 7, 8]).slots.tolist() == b.tolist()
    assert cache.match_prefix([1, 2, 9, 9]).slots.tolist() == c.tolist()
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == a.tolist()
    check_whole(allocator, cache)


def test_cache_finished_frees_duplicates_exactly() -> None:
    allocator, cache = make()
    tokens = [5, 6, 7, 8, 9, 10]
    # Two samples of one prompt both miss, compute [5..8] themselves, and finish in turn.
    m1, m2 = cache.match_prefix(tokens), cache.match_prefix(tokens)
    cache.lock(m1.node)
    cache.lock(m2.node)
    s1, s2 = allocator.allocate(6), allocator.allocate(6)
    check_whole(allocator, cache, live=12)
    cache.cache_finished(tokens, s1, m1.node, 0)
    check_whole(allocator, cache, live=6)
    free_before = allocator.available()
    cache.cache_finished(tokens[:4] + [11, 12], s2, m2.node, 0)
    assert allocator.available() == free_before + 4  # s2[:4] duplicated s1[:4]
    assert cache.total_size() == 8
    assert (
        cache.match_prefix(tokens[:4] + [11, 12]).slots.tolist()
        == s1[:4].tolist() + s2[4:].tolist()
    )
    check_whole(allocator, cache)


def test_cache_finished_keeps_locked_prefix() -> None:
    allocator, cache = make()
    finish(allocator, cache, [1, 2, 3])
    match = cache.match_prefix([1, 2, 3, 4])
    cache.lock(match.node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 0
    own = allocator.allocate(2)
    cache.cache_finished([1, 2, 3, 4, 5], torch.cat([match.slots, own]), match.node, 3)
    assert cache.protected_size() == 0 and cache.total_size() == 5
    assert allocator.available() == NUM_SLOTS - 5
    check_whole(allocator, cache)


def test_locked_nodes_survive_and_lru_order() -> None:
    allocator, cache = make()
    finish(allocator, cache, [1, 1])
    finish(allocator, cache, [2, 2, 2])
    finish(allocator, cache, [3, 3, 3, 3])
    cache.match_prefix([1, 1])  # [1, 1] is now the most recent, [2, 2, 2] the least
    locked = cache.match_prefix([3, 3, 3, 3]).node
    cache.lock(locked)
    assert cache.evict(1) == 3
    assert cache.match_prefix([2, 2, 2]).slots.numel() == 0
    assert cache.evict(100) == 2  # only [1, 1] is evictable
    assert cache.match_prefix([3, 3, 3, 3]).slots.numel() == 4
    assert cache.evict(1) == 0
    cache.unlock(locked)
    assert cache.evict(1) == 4
    assert cache.total_size() == 0 and allocator.available() == NUM_SLOTS


def test_lock_protects_ancestors_after_split() -> None:
    allocator, cache = make()
    finish(allocator, cache, [1, 2, 3, 4])
    finish(allocator, cache, [1, 2, 5])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    cache.match_prefix([1, 2, 3])  # splits the locked node: sizes must not change
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    check_whole(allocator, cache, locked=[node])
    assert cache.evict(10) == 1
    assert cache.match_prefix([1, 2, 3, 4]).slots.numel() == 4
    cache.unlock(node)
    with pytest.raises(RuntimeError):
        cache.unlock(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4


def test_evict_frees_requested_amount() -> None:
    allocator, cache = make()
    for first in range(1, 9):
        finish(allocator, cache, [first] * 5)
    assert cache.total_size() == 40
    freed = cache.evict(12)
    assert 12 <= freed < 12 + 5
    assert allocator.available() == NUM_SLOTS - 40 + freed
    assert cache.evict(1000) == 40 - freed
    check_whole(allocator, cache)


def test_evict_reaches_inner_nodes_in_one_call() -> None:
    allocator, cache = make()
    finish(allocator, cache, [1, 2, 3])
    finish(allocator, cache, [1, 2, 4])
    assert cache.evict(4) == 4  # both leaves, then [1, 2] once it is a leaf
    assert cache.total_size() == 0 and allocator.available() == NUM_SLOTS


def test_tree_does_not_alias_caller_slots() -> None:
    # On CPU the caller's slots are a view of its req->token row, which it reuses later.
    allocator, cache = make()
    row = torch.zeros(8, dtype=torch.int64)
    row[:3] = allocator.allocate(3)
    expected = row[:3].tolist()
    match = cache.match_prefix([1, 2, 3])
    cache.lock(match.node)
    cache.cache_finished([1, 2, 3], row[:3], match.node, 0)
    row.zero_()
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == expected


def test_cache_unfinished_returns_tree_slots_and_moves_lock() -> None:
    allocator, cache = make()
    other = finish(allocator, cache, [1, 2, 3, 4])
    tokens = [1, 2, 3, 4, 5, 6]
    match = cache.match_prefix([1, 2])  # the request matched early; [3, 4] was inserted meanwhile
    cache.lock(match.node)
    own = allocator.allocate(4)
    res = cache.cache_unfinished(tokens[:5], torch.cat([match.slots, own[:3]]), match.node, 2)
    assert res.slots.tolist() == other.tolist() + [own[2].item()]
    assert allocator.available() == NUM_SLOTS - 4 - 4 + 2  # own[0:2] were duplicates
    assert cache.protected_size() == 5 and cache.evictable_size() == 0
    check_whole(allocator, cache, live=1, locked=[res.node])
    assert cache.evict(100) == 0
    slots = torch.cat([res.slots, own[3:]])
    cache.cache_finished(tokens, slots, res.node, 5)
    assert cache.protected_size() == 0 and cache.total_size() == 6
    assert cache.match_prefix(tokens).slots.tolist() == slots.tolist()
    check_whole(allocator, cache)


def test_disabled_frees_everything_and_never_matches() -> None:
    allocator, cache = make(disable=True)
    for _ in range(3):
        match = cache.match_prefix([1, 2, 3])
        assert match.slots.numel() == 0 and match.node is cache.root
        cache.lock(match.node)
        slots = allocator.allocate(3)
        res = cache.cache_unfinished([1, 2, 3], slots, match.node, 0)
        assert res.slots is slots and res.node is cache.root
        cache.cache_finished([1, 2, 3, 4], torch.cat([slots, allocator.allocate(1)]), res.node, 0)
        assert allocator.available() == NUM_SLOTS and cache.total_size() == 0
    assert cache.evict(10) == 0


def test_reset_returns_pool_whole() -> None:
    allocator, cache = make()
    finish(allocator, cache, [1, 2, 3, 4])
    finish(allocator, cache, [1, 2, 7])
    node = cache.match_prefix([1, 2, 7]).node
    cache.lock(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(node)
    cache.reset()
    assert cache.total_size() == 0 and allocator.available() == NUM_SLOTS
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 0
    assert sorted(allocator.allocate(NUM_SLOTS).tolist()) == list(range(1, NUM_SLOTS + 1))


class Sim:
    """Requests that compute their tokens in random chunks, checking every cache answer against
    `kv_of`: slot -> the token sequence whose last token's KV was written there."""

    def __init__(self, rng: random.Random, num_slots: int) -> None:
        self.rng = rng
        self.allocator, self.cache = make(num_slots)
        self.kv_of: dict[int, tuple[int, ...]] = {}
        self.live: list[dict] = []
        self.prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 12))] for _ in range(4)]

    def owned(self) -> int:
        return sum(len(r["slots"]) - r["prefix_len"] for r in self.live)

    def check(self) -> None:
        locked = [r["node"] for r in self.live]
        check_whole(self.allocator, self.cache, live=self.owned(), locked=locked)
        held = tree_slots(self.cache) + [
            s for r in self.live for s in r["slots"][r["prefix_len"] :].tolist()
        ]
        assert len(held) == len(set(held))

    def check_slots(self, tokens: list[int], slots: torch.Tensor) -> None:
        for i, slot in enumerate(slots.tolist()):
            assert self.kv_of[slot] == tuple(tokens[: i + 1])

    def start(self) -> None:
        prompt = self.rng.choice(self.prefixes) + [
            self.rng.randrange(50) for _ in range(self.rng.randint(0, 8))
        ]
        tokens = prompt + [self.rng.randrange(50) for _ in range(self.rng.randint(1, 10))]
        match = self.cache.match_prefix(tokens[: len(tokens) - 1])
        self.check_slots(tokens, match.slots)
        self.cache.lock(match.node)
        m = len(match.slots)
        self.live.append(
            {"tokens": tokens, "slots": match.slots, "node": match.node, "prefix_len": m}
        )

    def compute(self, req: dict) -> bool:
        """Computes the next chunk of `req`; False when the pool can't hold it."""
        done = len(req["slots"])
        n = self.rng.randint(1, len(req["tokens"]) - done)
        if self.allocator.available() < n:
            self.cache.evict(n - self.allocator.available())
        new = self.allocator.allocate(n)
        if new is None:
            return False
        for j, slot in enumerate(new.tolist()):
            self.kv_of[slot] = tuple(req["tokens"][: done + j + 1])
        req["slots"] = torch.cat([req["slots"], new])
        if self.rng.random() < 0.5:
            kv_len = len(req["slots"])
            res = self.cache.cache_unfinished(
                req["tokens"][:kv_len], req["slots"], req["node"], req["prefix_len"]
            )
            self.check_slots(req["tokens"], res.slots)
            req.update(slots=res.slots, node=res.node, prefix_len=kv_len)
        return True

    def finish(self, req: dict) -> None:
        self.live.remove(req)
        kv_len = len(req["slots"])
        self.cache.cache_finished(
            req["tokens"][:kv_len], req["slots"], req["node"], req["prefix_len"]
        )

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.3 or not self.live:
            self.start()
        elif op < 0.75:
            req = self.rng.choice(self.live)
            if len(req["slots"]) == len(req["tokens"]) or not self.compute(req):
                self.finish(req)  # done, or aborted for lack of KV
        elif op < 0.95:
            self.finish(self.rng.choice(self.live))
        else:
            self.cache.evict(self.rng.randint(1, 20))
        self.check()


@pytest.mark.parametrize("seed", range(20))
def test_randomized_requests(seed: int) -> None:
    sim = Sim(random.Random(seed), num_slots=96)
    for _ in range(400):
        sim.step()
    while sim.live:
        sim.finish(sim.live[0])
    sim.check()
    assert sim.cache.protected_size() == 0
    for tokens in ([t for p in sim.prefixes for t in p], *sim.prefixes):
        sim.check_slots(tokens, sim.cache.match_prefix(tokens).slots)
    sim.cache.reset()
    assert sorted(sim.allocator.allocate(96).tolist()) == list(range(1, 97))
