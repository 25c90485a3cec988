"""Radix-tree prefix cache: token-id sequences -> KV slots (token granularity, page size 1).

Requests that share a prefix (the n samples of a GRPO prompt, the turns of a conversation)
reuse its KV instead of recomputing it.

Ownership contract:
- Slots stored in the tree are owned by the tree; only the tree frees them (`evict`, `reset`).
- A request that matched `m` tokens and locked the match's node owns none of those `m` slots;
  it owns the slots it allocated for the tokens after them. Handing them to `cache_finished` /
  `cache_unfinished` transfers them to the tree, which frees the ones it already had.
- A locked node, and so each of its ancestors, is never evicted: a locked prefix's slots stay
  valid until the matching `unlock`.
So at any time: allocator.available() + total_size() + slots owned by live requests == num_slots.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from rollout.forward.kv_pool import SlotAllocator


class TreeNode:
    """An edge of the tree: `key` tokens whose KV lives at `value` (int64 [len(key)])."""

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, TreeNode] = {}  # keyed by the child's first token
        self.lock_ref = 0  # requests whose locked node is this one or a descendant
        self.last_access = 0

    def __len__(self) -> int:
        return len(self.key)

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access < other.last_access


@dataclass
class MatchResult:
    slots: torch.Tensor  # int64 [m], KV slots of the longest cached prefix
    node: TreeNode  # deepest node of the match (root when m == 0); lock it to keep the prefix


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


_EMPTY = torch.empty(0, dtype=torch.int64)


class RadixCache:
    def __init__(self, allocator: SlotAllocator, disable: bool = False) -> None:
        self.allocator = allocator
        self.disable = disable
        self._clock = itertools.count(1)  # LRU stamps: larger is more recent
        self._clear()

    def _clear(self) -> None:
        self.root = TreeNode([], _EMPTY, None)  # the base model's KV
        # One tree per namespace (a LoRA adapter's KV: rollout/engine/lora_manager.py), so a
        # prefix computed under one is never matched under another.
        self.roots: dict[Hashable, TreeNode] = {None: self.root}
        self._evictable = 0
        self._protected = 0

    # ---- lookup -------------------------------------------------------------------------

    def _root(self, namespace: Hashable) -> TreeNode:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = TreeNode([], _EMPTY, None)
        return root

    def match_prefix(self, tokens: list[int], namespace: Hashable = None) -> MatchResult:
        """Longest cached prefix of `tokens` in `namespace`'s tree. Splits a node when the match
        ends inside it, so the returned node covers exactly the match; refreshes the access
        time along the path. The slots stay valid only while the node is locked (or until the
        next evict)."""
        if self.disable:
            return MatchResult(_EMPTY.clone(), self.root)
        stamp = next(self._clock)
        node, i, values = self._root(namespace), 0, []
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            n = _common_len(child.key, tokens[i:])
            partial = n < len(child)
            if partial:
                child = self._split(child, n)
            child.last_access = stamp
            values.append(child.value)
            node, i = child, i + n
            if partial:
                break
        slots = torch.cat(values) if values else _EMPTY.clone()
        return MatchResult(slots, node)

    def lock(self, node: TreeNode) -> None:
        """Pins `node` and its ancestors against eviction. O(depth)."""
        while node.parent is not None:  # a tree's root holds nothing
            if node.lock_ref == 0:
                self._evictable -= len(node)
                self._protected += len(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undoes one `lock(node)`."""
        while node.parent is not None:
            if node.lock_ref == 0:
                raise RuntimeError("unlock of a radix-cache node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node)
                self._protected -= len(node)
            node = node.parent

    # ---- insertion ----------------------------------------------------------------------

    def cache_finished(
        self, tokens: list[int], slots: torch.Tensor, locked: TreeNode, prefix_len: int,
        namespace: Hashable = None,
    ) -> None:  # fmt: skip
        """A finished (or aborted) request hands over its KV: tokens[i] has KV at slots[i].
        slots[:prefix_len] are the tree-owned slots of its locked match (`locked`); the rest are
        the request's. Afterwards the request owns nothing: its slots are in the tree or freed
        (those for tokens someone else inserted meanwhile), and `locked` is unlocked."""
        if len(tokens) != slots.numel():
            raise ValueError(f"{len(tokens)} tokens but {slots.numel()} slots")
        if self.disable:
            self.allocator.free(slots[prefix_len:])
            return
        _, present = self._insert(tokens, slots, namespace)
        self.allocator.free(slots[prefix_len:present])
        self.unlock(locked)

    def cache_unfinished(
        self, tokens: list[int], slots: torch.Tensor, locked: TreeNode, prefix_len: int,
        namespace: Hashable = None,
    ) -> MatchResult:  # fmt: skip
        """A running request (a prefill chunk done) hands over the KV computed so far, as in
        `cache_finished`, but keeps it: the result holds the tree's slots for all of `tokens`
        (write them back to the request's row, since duplicates were freed) and the new
        deepest node, now locked in place of `locked`. Afterwards prefix_len = len(tokens).
        Disabled: returns `slots` and the root unchanged, locking nothing."""
        if len(tokens) != slots.numel():
            raise ValueError(f"{len(tokens)} tokens but {slots.numel()} slots")
        if self.disable:
            return MatchResult(slots, self.root)
        node, present = self._insert(tokens, slots, namespace)
        self.allocator.free(slots[prefix_len:present])
        self.lock(node)
        self.unlock(locked)
        return MatchResult(self._path_slots(node), node)

    def _insert(
        self, tokens: list[int], slots: torch.Tensor, namespace: Hashable
    ) -> tuple[TreeNode, int]:
        """Adds tokens -> slots where absent. Returns the node ending exactly at len(tokens) and
        how many leading tokens were already cached (the tree keeps its own slots for those)."""
        # NOTE: a request's locked prefix is in the tree, so `present` >= its prefix_len and the
        # request's slots[:prefix_len] (tree-owned) are never among those freed by the caller.
        stamp = next(self._clock)
        node, i = self._root(namespace), 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = TreeNode(tokens[i:], slots[i:].clone(), node)
                child.last_access = stamp
                node.children[tokens[i]] = child
                self._evictable += len(child)
                return child, i
            n = _common_len(child.key, tokens[i:])
            if n < len(child):
                child = self._split(child, n)
            child.last_access = stamp
            node, i = child, i + n
        return node, i

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cuts `child` after its n-th token; returns the new upper part (same locks, same LRU
        stamp), so sizes and the locks held through `child` are unchanged."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.children[child.key[n]] = child
        child.parent.children[child.key[0]] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        return upper

    def _path_slots(self, node: TreeNode) -> torch.Tensor:
        values = []
        while node.parent is not None:
            values.append(node.value)
            node = node.parent
        return torch.cat(values[::-1]) if values else _EMPTY.clone()

    # ---- eviction and sizes -------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` slots (whole nodes, so possibly more) from unlocked
        leaves, least recently used first, or all evictable slots if there are fewer.
        Returns how many slots were freed."""
        if self.disable or num_tokens <= 0:
            return 0
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += len(leaf)
            self._evictable -= len(leaf)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            # NOTE: an unlocked node's descendants are all unlocked, so a parent left childless
            # is evictable iff it is itself unlocked.
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _nodes(self) -> list[TreeNode]:
        """Every node but the roots."""
        out, stack = [], [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def evictable_size(self) -> int:
        """Slots in unlocked nodes."""
        return self._evictable

    def protected_size(self) -> int:
        """Slots in locked nodes."""
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def reset(self) -> None:
        """Frees every slot the tree holds and empties it. Nothing may be locked."""
        if self._protected:
            raise RuntimeError(
                f"reset of the radix cache with {self._protected} slots still locked; "
                "release every request first"
            )
        values = [n.value for n in self._nodes()]
        if values:
            self.allocator.free(torch.cat(values))
        self._clear()
