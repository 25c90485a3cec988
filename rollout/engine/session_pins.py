"""SessionPins: the KV that open sessions keep locked in the radix cache between turns.

When a turn of a session finishes, its KV goes to the prefix cache as any request's does, and
the session locks the cached path of its tokens, so the next turn finds it however many other
requests ran in between. The locks go when the session closes, when the cache is flushed, or
when the weights change (KV of older weights is never reused): a later turn then recomputes
what it no longer finds. Sessions never lock more than MAX_PINNED_SHARE of the pool (counting
the prefixes running requests lock): beyond that a turn's KV stays in the cache unpinned, so
open sessions can't starve new requests of KV. A request that needs more than the pins leave
(up to the whole pool) gets it: when nothing can run, the sessions' pins go, least recently
used first, until something can (KVManager.yield_pins), and those sessions' next turns
recompute what was evicted.
"""

from __future__ import annotations

from collections.abc import Hashable

from rollout.engine.radix_cache import RadixCache, TreeNode

MAX_PINNED_SHARE = 0.5


class SessionPins:
    def __init__(self, num_slots: int) -> None:
        self.limit = int(num_slots * MAX_PINNED_SHARE)
        self.nodes: dict[str, list[TreeNode]] = {}  # session id -> the nodes it locked

    def pin(
        self, cache: RadixCache, session_id: str, tokens: list[int], namespace: Hashable = None
    ) -> None:
        """Locks the cached prefix of `tokens` (a finished turn's, in its cache namespace) for
        the session."""
        if cache.disable or not tokens:
            return
        node = cache.match_prefix(tokens, namespace).node
        if node.parent is None:  # a root: nothing cached
            return
        if cache.protected_size() + _unlocked_len(node) > self.limit:
            return
        cache.lock(node)
        nodes = self.nodes.pop(session_id, [])  # to the end: the sessions go in order of use
        nodes.append(node)
        self.nodes[session_id] = nodes

    def unpin(self, cache: RadixCache, session_id: str) -> None:
        """Unlocks what the session locked (its KV stays cached, evictable)."""
        for node in self.nodes.pop(session_id, []):
            cache.unlock(node)

    def unpin_least_recent(self, cache: RadixCache) -> str:
        """Unlocks what the session whose last turn finished longest ago locked; its id."""
        session_id = next(iter(self.nodes))
        self.unpin(cache, session_id)
        return session_id

    def unpin_all(self, cache: RadixCache) -> None:
        for session_id in list(self.nodes):
            self.unpin(cache, session_id)

    def pinned_sessions(self) -> int:
        return len(self.nodes)

    def pinned_tokens(self) -> int:
        """Tokens of the cached paths the sessions lock, each counted once (sessions that
        branch from one turn share its path)."""
        seen: set[int] = set()
        total = 0
        for nodes in self.nodes.values():
            for node in nodes:
                while node.parent is not None and id(node) not in seen:
                    seen.add(id(node))
                    total += len(node)
                    node = node.parent
        return total


def _unlocked_len(node: TreeNode) -> int:
    """Tokens on the path to `node` that no lock protects yet."""
    total = 0
    while node.parent is not None and node.lock_ref == 0:
        total += len(node)
        node = node.parent
    return total
