"""KVManager: every KV slot and req->token row a request holds goes through here.

Invariant (checked by `is_whole` when idle): free slots + slots held by the radix cache (and by
the stale caches of older weights) + slots held by live requests == pool size.
"""

from __future__ import annotations

import logging

import torch

from rollout.engine.radix_cache import RadixCache
from rollout.engine.req import Req
from rollout.engine.session_pins import SessionPins
from rollout.forward.kv_pool import ReqToTokenPool, SlotAllocator

logger = logging.getLogger(__name__)


class KVManager:
    def __init__(self, num_slots: int, req_to_token: ReqToTokenPool, disable_cache: bool) -> None:
        self.allocator = SlotAllocator(num_slots)
        self.req_to_token = req_to_token
        self.cache = RadixCache(self.allocator, disable=disable_cache)
        self.num_slots = num_slots
        # After a weight change: the caches of older weights, kept only while live requests still
        # lock parts of them, and which of those caches each such request's row belongs to.
        self.stale_caches: list[RadixCache] = []
        self._stale_rows: dict[int, RadixCache] = {}
        self.pins = SessionPins(num_slots)  # open sessions' finished turns, kept cached

    def free_slots(self) -> int:
        """Slots obtainable now, evicting unlocked cache entries if need be."""
        return self.allocator.available() + self.cache.evictable_size()

    def attach(self, req: Req) -> bool:
        """Gives a waiting request a table row and its longest cached prefix (locked).
        Returns False, changing nothing, when no row is free."""
        row = self.req_to_token.allocate()
        if row is None:
            return False
        match = self.cache.match_prefix(req.ids[: req.max_cacheable_prefix()], req.cache_namespace)
        self.cache.lock(match.node)
        req.row, req.locked_node = row, match.node
        req.prefix_len = req.kv_len = len(match.slots)
        self.req_to_token.write(row, 0, match.slots)
        return True

    def allocate(self, req: Req, n: int) -> torch.Tensor | None:
        """Slots for req's next n tokens (positions kv_len ..), written to its row; None if the
        pool can't supply them even after eviction."""
        if self.allocator.available() < n:
            self.cache.evict(n - self.allocator.available())
        slots = self.allocator.allocate(n)
        if slots is None:
            return None
        self.req_to_token.write(req.row, req.kv_len, slots)
        return slots

    def allocate_decode(self, reqs: list[Req]) -> torch.Tensor | None:
        """One slot for each request's next token, written to the rows in one indexed copy (a
        decode step must not pay one host-to-device copy per request); None if the pool can't."""
        n = len(reqs)
        if self.allocator.available() < n:
            self.cache.evict(n - self.allocator.available())
        slots = self.allocator.allocate(n)
        if slots is None:
            return None
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64)
        cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        self.req_to_token.write_many(rows, cols, slots)
        return slots

    def free_unused(self, slots: torch.Tensor) -> None:
        """Frees slots allocated for a step that never ran (its launch failed): no request's
        kv_len counts them, so no release would."""
        self.allocator.free(slots)

    def insert_computed(self, req: Req) -> None:
        """After a prefill chunk: put the request's computed KV in the cache so requests arriving
        next (the other samples of a GRPO prompt) reuse it; the request keeps it locked."""
        if self.cache.disable or req.row in self._stale_rows:
            return  # the request keeps owning all its (new) slots
        tokens = req.ids[: req.kv_len]
        slots = self.req_to_token.read(req.row, 0, req.kv_len)
        match = self.cache.cache_unfinished(
            tokens, slots, req.locked_node, req.prefix_len, req.cache_namespace
        )
        self.req_to_token.write(req.row, 0, match.slots)
        req.locked_node = match.node
        req.prefix_len = req.kv_len

    def truncate(self, req: Req, kv_len: int) -> None:
        """Frees the request's slots of positions kv_len .. req.kv_len (slots it owns: kv_len is
        never inside its cached prefix) and shortens its KV to kv_len."""
        if req.row is None or req.kv_len <= kv_len:
            return
        assert kv_len >= req.prefix_len, f"{kv_len} is inside the cached prefix ({req.prefix_len})"
        self.allocator.free(self.req_to_token.read(req.row, kv_len, req.kv_len))
        req.kv_len = kv_len

    def release(self, req: Req) -> None:
        """Returns everything the request holds: its computed KV goes to the cache (unlocked), its row
        back to the table. Afterwards the request holds nothing and could be re-attached."""
        if req.row is None:
            return
        stale = self._stale_rows.pop(req.row, None)
        if stale is not None:
            # KV of older weights: never cached again. Free what the request owns, unlock its
            # prefix in the old cache, and drop that cache once nobody holds any of it.
            self.allocator.free(self.req_to_token.read(req.row, req.prefix_len, req.kv_len))
            stale.unlock(req.locked_node)
            stale.evict(stale.evictable_size())
            if stale.total_size() == 0:
                self.stale_caches.remove(stale)
        else:
            tokens = req.ids[: req.kv_len]
            slots = self.req_to_token.read(req.row, 0, req.kv_len)
            self.cache.cache_finished(
                tokens, slots, req.locked_node, req.prefix_len, req.cache_namespace
            )
            if req.finished and req.req.session_params is not None:
                sid = req.req.session_params.id
                self.pins.pin(self.cache, sid, tokens, req.cache_namespace)
        self.req_to_token.free(req.row)
        req.row, req.locked_node = None, None
        req.prefix_len = req.kv_len = 0

    def flush(self) -> None:
        """Drops the whole prefix cache. Only when no request holds KV."""
        self.pins.unpin_all(self.cache)
        self.cache.reset()

    def invalidate_cache(self, live: list[Req]) -> None:
        """The weights changed: no request attached from now on reuses KV computed before. The
        cache starts empty; what the old one held is freed, except prefixes that `live` requests
        lock: those stay until the request releases them, and nothing a live request computed
        (before or after this call) is cached again."""
        self.pins.unpin_all(self.cache)  # sessions never reuse KV of older weights
        old = self.cache
        self.cache = RadixCache(self.allocator, disable=old.disable)
        if old.disable:
            return
        for req in live:
            if req.row is not None:
                self._stale_rows.setdefault(req.row, old)
        old.evict(old.evictable_size())
        if old.total_size():
            self.stale_caches.append(old)

    def yield_pins(self) -> bool:
        """The pool can't supply what a queued or running request needs and nothing in flight
        will free any: the KV kept by the session used least recently becomes evictable (its
        next turn recomputes what is evicted). False if no session kept any."""
        if not self.pins.nodes:
            return False
        session_id = self.pins.unpin_least_recent(self.cache)
        logger.warning(
            "KV pool full: session %r's cached turns are no longer kept, for requests that need "
            "the room (its next turn recomputes them); %d sessions still keep theirs",
            session_id,
            self.pins.pinned_sessions(),
        )
        return True

    def close_session(self, session_id: str) -> None:
        """The session's finished turns' KV is no longer kept: it stays cached, evictable."""
        self.pins.unpin(self.cache, session_id)

    def _stale_size(self) -> int:
        return sum(c.total_size() for c in self.stale_caches)

    def is_whole(self) -> bool:
        held = self.cache.total_size() + self._stale_size()
        return self.allocator.available() + held == self.num_slots

    def usage(self) -> dict[str, int]:
        held = self.cache.total_size() + self._stale_size()
        return {
            "kv_total": self.num_slots,
            "kv_free": self.allocator.available(),
            "kv_cached": self.cache.total_size(),
            "kv_evictable": self.cache.evictable_size(),
            "kv_stale": self._stale_size(),
            "kv_in_requests": self.num_slots - self.allocator.available() - held,
            "kv_pinned_by_sessions": self.pins.pinned_tokens(),
            "sessions_with_pinned_kv": self.pins.pinned_sessions(),
        }
