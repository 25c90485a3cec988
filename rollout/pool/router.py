"""Router: which replica serves a request. Pure Python, no Ray, no I/O.

Three rules, in order:
1. pinned: a request whose rid was routed before (a session's next turn reusing its rid) goes
   where that rid went, while that replica serves;
2. prefix: a request whose prompt starts with a prefix routed before goes to the replica that
   served it, where the prefix (radix) cache most likely still holds its KV: the samples of a
   GRPO group sent one by one, the turns of a multi-turn rollout (turn k+1's prompt extends
   turn k's). Unless that replica is overloaded: more than `max_imbalance_tokens` above the
   least-loaded one;
3. least load: the replica with the fewest outstanding tokens (prompt + max_new_tokens, times
   n, of the requests the pool has sent it and not seen finish).

Prefixes are indexed as chains of block hashes (a block: `block_size` token ids, or 4x as many
characters for a text prompt), the last partial block included, so that equal short prompts
match too. The index is bounded (least recently used entries go first) and forgets a
replica's entries when the replica restarts with an empty cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

CHARS_PER_TOKEN = 4  # text prompts are routed on characters: about this many per token


@dataclass(frozen=True)
class Route:
    replica: int
    reason: str  # "pinned", "prefix" or "least_load"
    matched_tokens: int = 0  # the prefix already routed to `replica` (estimated for text)


@dataclass
class ReplicaCounters:
    """What the router decided for one replica, and its load now."""

    routed: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    pinned: int = 0
    least_load: int = 0
    load_tokens: int = 0
    in_flight: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        hit_rate = self.prefix_hits / self.routed if self.routed else 0.0
        return {
            "routed": self.routed,
            "prefix_hits": self.prefix_hits,
            "prefix_hit_rate": hit_rate,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "pinned": self.pinned,
            "least_load": self.least_load,
            "load_tokens": self.load_tokens,
            "in_flight": self.in_flight,
            **self.extra,
        }


class Chain(list):
    """A prompt's blocks as the index sees them: (hash of the prefix up to the block's end, the
    prefix length in tokens) each (PrefixIndex.chain)."""


class PrefixIndex:
    """Block-hash chains of routed prompts -> the replica that last served them (LRU-bounded)."""

    def __init__(self, block_size: int, max_entries: int) -> None:
        if block_size < 1 or max_entries < 1:
            raise ValueError(
                f"block_size and max_entries must be >= 1, got {block_size}, {max_entries}"
            )
        self.block_size = block_size
        self.max_entries = max_entries
        self._owner: OrderedDict[int, int] = OrderedDict()

    def chain(self, key: list[int] | str) -> Chain:
        """(hash of the prefix up to the block's end, the prefix length in tokens) per block:
        what match and insert take, made once per request."""
        text = isinstance(key, str)
        size = self.block_size * (CHARS_PER_TOKEN if text else 1)
        h = hash(("text" if text else "ids", size))
        items = key if text else tuple(key)  # its slices are hashable, made in one step each
        chain = Chain()
        for start in range(0, len(items), size):
            block = items[start : start + size]
            h = hash((h, block))
            end = start + len(block)
            chain.append((h, end // CHARS_PER_TOKEN if text else end))
        return chain

    def match(self, key: list[int] | str | Chain, serving: set[int]) -> tuple[int | None, int]:
        """The serving replica holding the longest routed prefix of `key` (a prompt or its
        chain), and its length."""
        best, length = None, 0
        get = self._owner.get
        for h, end in self._as_chain(key):
            owner = get(h)
            if owner is None:
                break
            if owner in serving:
                best, length = owner, end
        return best, length

    def insert(self, key: list[int] | str | Chain, replica: int) -> None:
        owners = self._owner
        for h, _ in self._as_chain(key):
            if h in owners:
                owners.move_to_end(h)
            owners[h] = replica
        while len(owners) > self.max_entries:
            owners.popitem(last=False)

    def _as_chain(self, key: list[int] | str | Chain) -> Chain:
        return key if isinstance(key, Chain) else self.chain(key)

    def forget(self, replica: int) -> None:
        for h in [h for h, owner in self._owner.items() if owner == replica]:
            del self._owner[h]

    def __len__(self) -> int:
        return len(self._owner)


class Router:
    def __init__(
        self, num_replicas: int, block_size: int = 16, max_prefix_entries: int = 1 << 18,
        max_imbalance_tokens: int = 1 << 16, max_pins: int = 1 << 16,
    ) -> None:  # fmt: skip
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if max_imbalance_tokens < 0:
            raise ValueError(f"max_imbalance_tokens must be >= 0, got {max_imbalance_tokens}")
        self.index = PrefixIndex(block_size, max_prefix_entries)
        self.max_imbalance_tokens = max_imbalance_tokens
        self.max_pins = max_pins
        self.counters = [ReplicaCounters() for _ in range(num_replicas)]
        self._pins: OrderedDict[str, int] = OrderedDict()  # rids, the newest max_pins
        self._held: dict[str, int] = {}  # pin()'s keys (open sessions): kept until unpin

    def route(
        self, key: list[int] | str | None, serving: Iterable[int], rid: str | None = None
    ) -> Route:
        """Chooses among `serving` (replica indices) and records the choice (counters, the
        prefix index, the rid's pin). Raises ValueError when nothing serves."""
        serving = set(serving)
        if not serving:
            raise ValueError("no replica is serving")
        chain = self.index.chain(key) if key else None
        route = self._choose(chain, serving, rid)
        counters = self.counters[route.replica]
        counters.routed += 1
        if route.reason == "prefix":
            counters.prefix_hits += 1
            counters.prefix_hit_tokens += route.matched_tokens
        elif route.reason == "pinned":
            counters.pinned += 1
        else:
            counters.least_load += 1
        if chain:
            self.index.insert(chain, route.replica)
        if rid is not None:
            self._pins[rid] = route.replica
            self._pins.move_to_end(rid)
            while len(self._pins) > self.max_pins:
                self._pins.popitem(last=False)
        return route

    def _choose(self, chain: Chain | None, serving: set[int], rid: str | None) -> Route:
        pinned = self.pinned_replica(rid) if rid is not None else None
        if pinned in serving:
            return Route(pinned, "pinned")
        least = min(
            serving, key=lambda i: (self.counters[i].load_tokens, self.counters[i].in_flight, i)
        )
        if chain:
            owner, matched = self.index.match(chain, serving)
            floor = self.counters[least].load_tokens + self.max_imbalance_tokens
            if owner is not None and self.counters[owner].load_tokens <= floor:
                return Route(owner, "prefix", matched)
        return Route(least, "least_load")

    def pinned_replica(self, rid: str) -> int | None:
        held = self._held.get(rid)
        return held if held is not None else self._pins.get(rid)

    def pin(self, key: str, replica: int) -> None:
        """Sends every later request pinned by `key` (a session) to `replica`, however many
        rids are pinned meanwhile, until unpin."""
        self._held[key] = replica

    def unpin(self, key: str) -> None:
        self._held.pop(key, None)
        self._pins.pop(key, None)

    def started(self, replica: int, tokens: int) -> None:
        """A request of `tokens` outstanding tokens was sent to `replica`."""
        self.counters[replica].load_tokens += tokens
        self.counters[replica].in_flight += 1

    def finished(self, replica: int, tokens: int) -> None:
        self.counters[replica].load_tokens -= tokens
        self.counters[replica].in_flight -= 1

    def count(self, replica: int, event: str) -> None:
        """Counts an event of the pool's own (a retry, a restart) in the replica's stats."""
        extra = self.counters[replica].extra
        extra[event] = extra.get(event, 0) + 1

    def forget(self, replica: int) -> None:
        """`replica` restarted: its prefix cache and its pins are gone."""
        self.index.forget(replica)
        for rid in [r for r, i in self._pins.items() if i == replica]:
            del self._pins[rid]
        for key in [k for k, i in self._held.items() if i == replica]:
            del self._held[key]

    def stats(self) -> list[dict]:
        return [c.as_dict() for c in self.counters]
