"""KVManager: every KV slot and req->token row a request holds goes through here.

Invariant (checked by `is_whole` when idle): free slots + slots held by the radix cache +
slots held by live requests == pool size.
"""

from __future__ import annotations

import torch

from rollout.engine.kv_pool import ReqToTokenPool, SlotAllocator
from rollout.engine.radix_cache import RadixCache
from rollout.engine.req import Req


class KVManager:
    def __init__(self, num_slots: int, req_to_token: ReqToTokenPool, disable_cache: bool) -> None:
        self.allocator = SlotAllocator(num_slots)
        self.req_to_token = req_to_token
        self.cache = RadixCache(self.allocator, disable=disable_cache)
        self.num_slots = num_slots

    def free_slots(self) -> int:
        """Slots obtainable now, evicting unlocked cache entries if need be."""
        return self.allocator.available() + self.cache.evictable_size()

    def attach(self, req: Req) -> bool:
        """Gives a waiting request a table row and its longest cached prefix (locked).
        Returns False, changing nothing, when no row is free."""
        row = self.req_to_token.allocate()
        if row is None:
            return False
        match = self.cache.match_prefix(req.ids[: req.max_cacheable_prefix()])
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

    def insert_computed(self, req: Req) -> None:
        """After a prefill chunk: put the request's computed KV in the cache so requests arriving
        next (the other samples of a GRPO prompt) reuse it; the request keeps it locked."""
        if self.cache.disable:
            return  # the request keeps owning all its slots
        tokens = req.ids[: req.kv_len]
        slots = self.req_to_token.read(req.row, 0, req.kv_len).cpu()
        match = self.cache.cache_unfinished(tokens, slots, req.locked_node, req.prefix_len)
        self.req_to_token.write(req.row, 0, match.slots)
        req.locked_node = match.node
        req.prefix_len = req.kv_len

    def release(self, req: Req) -> None:
        """Returns everything the request holds: its computed KV goes to the cache (unlocked), its row
        back to the table. Afterwards the request holds nothing and could be re-attached."""
        if req.row is None:
            return
        tokens = req.ids[: req.kv_len]
        slots = self.req_to_token.read(req.row, 0, req.kv_len).cpu()
        self.cache.cache_finished(tokens, slots, req.locked_node, req.prefix_len)
        self.req_to_token.free(req.row)
        req.row, req.locked_node = None, None
        req.prefix_len = req.kv_len = 0

    def flush(self) -> None:
        """Drops the whole prefix cache. Only when no request holds KV."""
        self.cache.reset()

    def is_whole(self) -> bool:
        return self.allocator.available() + self.cache.total_size() == self.num_slots

    def usage(self) -> dict[str, int]:
        return {
            "kv_total": self.num_slots,
            "kv_free": self.allocator.available(),
            "kv_cached": self.cache.total_size(),
            "kv_evictable": self.cache.evictable_size(),
            "kv_in_requests": self.num_slots - self.allocator.available() - self.cache.total_size(),
        }
