"""PoolWeights: every weight, version, pause and memory call, fanned out to the replicas.

A weight update reaches every replica or none keeps it:
1. generation pauses on every replica (in place: requests keep their KV), so that each one
   stages the update instead of applying it;
2. the update goes to every replica at once (a distributed update: all of them receive the one
   broadcast of the trainer);
3. all staged it: continue_generation on every replica applies it, under one version label
   that the pool chose for all. One refused or failed: the others drop what they staged
   (discard_staged_weights) and go on with the weights and version they had.
A replica that cannot drop its staged update, or that fails to apply it at continue, is
restarted and given the pool's current weights (see restore).

An update with lora_name (new values of a loaded LoRA adapter) takes the same path, under
the adapter's own label; the pool remembers where its values can be had again
(adapter_source.py). Calls made while the pool is paused (pause_generation) stage the same way
and apply at the pool's continue_generation. Every update runs under one lock, which a
restarting replica's restore takes too, so that it never misses an update nor sees half of
one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rollout.errors import InvalidRequest, RequestError, WeightSyncError
from rollout.pool.adapter_source import AdapterSources
from rollout.pool.replica import Replica, ReplicaDead
from rollout.pool.staged import hold_as_the_others
from rollout.pool.supervisor import StaleWeights, Supervisor
from rollout.pool.weight_source import Snapshot, WeightSource

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Group:
    """An update group the replicas joined: the incarnation each had when it joined."""

    incarnations: tuple[int, ...]


class PoolWeights:
    def __init__(
        self, supervisor: Supervisor, source: WeightSource,
        adapters: AdapterSources | None = None,
    ) -> None:  # fmt: skip
        self.sup = supervisor
        self.source = source  # what restores a restarted replica, and the version labels
        self.adapters = adapters or AdapterSources()  # the same, per LoRA adapter
        self.lock = asyncio.Lock()
        self.paused: str | None = None  # the pool's own pause mode, set by pause_generation
        self.staged_version: str | None = None  # staged while the pool is paused
        self.pending: list[tuple] = []  # the updates staged meanwhile, recorded at continue
        self.groups: dict[str, Group] = {}
        self.released: set[str] = set()  # the memory tags every replica has released
        # Commits of new base-model weights on every replica (as one engine counts them: a
        # continue applying several staged updates is one), whatever a restart resets.
        self.weight_updates = 0

    # ---- updates ------------------------------------------------------------------------------
    async def update(
        self, method: str, args: tuple, kwargs: dict, version: str | None,
        snapshot: Snapshot | None = None,
    ) -> dict:  # fmt: skip
        """Runs the update `method(*args, **kwargs, weight_version=label)` on every replica
        that is up, all or nothing. Returns the first replica's result, with the label.
        `snapshot` gives the tensors of a tensor update, for the pool's copy."""
        async with self.lock:
            targets = self.sup.serving()
            if method == "update_weights_from_distributed":
                targets = self._group_members(kwargs["group_name"])
            if not targets:
                raise WeightSyncError(f"no replica to update ({self.sup.describe()})")
            # While paused, an unnamed update joins the label of those staged before it.
            lora = kwargs.get("lora_name")
            if lora is not None:  # an adapter's own label (adapter_source.py)
                label = self.adapters.next_label(lora, version)
            else:
                label = version or self.staged_version or self.source.next_label(None)
            kwargs = {**kwargs, "weight_version": label}
            await self._staged(targets, method, args, kwargs)
            update = (method, args, kwargs, label, self.source.capture(method, args, snapshot))
            if self.paused is not None:
                if lora is not None:
                    self.adapters.staged[lora] = label
                else:
                    self.staged_version = label
                self.pending.append(update)
                return self._result(method, targets, label, lora)
            if lora is not None:
                await self._commit(targets, None, {lora: label})
            else:
                await self._commit(targets, label)
                self.weight_updates += 1
            self._record(update, label)
            await self._refresh_stale()
            return self._result(method, targets, label, lora)

    def _result(self, method: str, targets: list[int], label: str, lora: str | None) -> dict:
        staged = {"staged": True} if self.paused is not None else {}
        adapter = {"lora_name": lora} if lora is not None else {}
        message = f"{method} on {len(targets)} replicas"
        result = {"success": True, "message": message, "weight_version": label, **adapter}
        return {**result, "replicas": len(targets), **staged}

    def _record(self, update: tuple, label: str) -> None:
        """`update` now serves on every replica, as `label`."""
        method, args, kwargs, _, copied = update
        lora = kwargs.get("lora_name")
        if lora is None:
            self.source.record(method, args, kwargs, label, copied)
        else:
            self.adapters.record(lora, method, args, kwargs, label, copied)

    def _applied(self, label: str | None) -> None:
        """The updates staged while the pool was paused now serve: the base model's under
        `label`, each adapter's under the last label staged for it (one unloaded meanwhile
        was dropped by every replica)."""
        if label is not None and any(u[2].get("lora_name") is None for u in self.pending):
            self.weight_updates += 1
        for update in self.pending:
            lora = update[2].get("lora_name")
            if lora is None and label is not None:
                self._record(update, label)
            elif lora in self.adapters.staged:
                self._record(update, self.adapters.staged[lora])
        self.pending.clear()
        self.staged_version = None
        self.adapters.staged.clear()
        if label is not None:
            self.source.relabel(label)

    async def _refresh_stale(self) -> None:
        """Stale replicas (restarted when the pool had no copy of its weights) get them now,
        if this update gave the pool a copy of everything."""
        for i in self.sup.stale():
            try:
                await self._bring_up(self.sup.replicas[i])
            except StaleWeights:
                continue
            except ReplicaDead as e:
                self.sup.mark_dead(i, str(e))
                continue
            self.sup.set_serving(i)

    async def _staged(self, targets: list[int], method: str, args: tuple, kwargs: dict) -> None:
        own_pause = self.paused is None
        if own_pause:
            await self.fan_out("pause_generation", mode="in_place", among=targets)
        results = await asyncio.gather(
            *(self.sup.call(i, method, *args, **kwargs) for i in targets), return_exceptions=True
        )
        failed = {i: e for i, e in zip(targets, results) if isinstance(e, BaseException)}
        if not failed:
            return
        kept = [i for i in targets if i not in failed]
        if not own_pause:  # a refused adapter update leaves what was staged before it
            kept += [i for i, e in failed.items() if not isinstance(e, ReplicaDead)]
        dropped = await asyncio.gather(
            *(self.sup.call(i, "discard_staged_weights") for i in kept),
            return_exceptions=True,
        )
        for i, d in zip(kept, dropped):
            if isinstance(d, BaseException):  # it would apply the update: start it afresh
                self.sup.mark_dead(i, f"could not drop a staged update ({d})")
        for i, e in failed.items():
            if isinstance(e, ReplicaDead):
                self.sup.mark_dead(i, str(e))
        if own_pause:
            await self._continue([i for i in targets if i in self.sup.up()])
            what = "the update was"
        else:  # a refused update takes the ones staged before it down with it, on every engine
            what = "every update staged since the pause was"
            self.pending.clear()
            self.staged_version = None
            self.adapters.staged.clear()
        lora = kwargs.get("lora_name")
        version = self.source.version if lora is None else self.adapters.next_label(lora, None)
        serves = f"LoRA adapter {lora!r}'s" if lora is not None else "the pool serves"
        dropped = f"{what} dropped on every replica: {serves} {version!r} as before"
        raise _refusal(failed, self.sup, dropped)

    async def _commit(
        self, targets: list[int], label: str | None, adapters: dict[str, str] | None = None
    ) -> None:
        """Continues `targets`, which apply what they staged: the base model's weights as
        `label` (None: none staged) and each adapter of `adapters` as its label."""
        results = await self._continue(targets)
        for i, result in zip(targets, results):
            if not _applied_as(result, label, adapters or {}):
                # It rolled back at apply time while the others applied: start it afresh with
                # the new weights rather than serve two versions.
                what = label if label is not None else adapters
                self.sup.mark_dead(i, f"failed to apply the update {what!r}: {result}")

    async def _continue(self, targets: list[int]) -> list:
        return await asyncio.gather(
            *(self.sup.call(i, "continue_generation") for i in targets),
            return_exceptions=True,
        )

    # ---- update groups ------------------------------------------------------------------------
    async def init_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str, backend: str, timeout_s: float | None,
    ) -> dict:  # fmt: skip
        """Replica i joins at rank_offset + the ranks of replicas 0..i-1; the trainer's ranks
        come first, so world_size = rank_offset + every replica's ranks."""
        async with self.lock:
            targets = list(range(len(self.sup.replicas)))
            down = [self.sup.replicas[i].name for i in targets if i not in self.sup.serving()]
            if down:
                raise WeightSyncError(f"{', '.join(down)} not serving: {self.sup.describe()}")
            ranks = [self.sup.replicas[i].ranks for i in targets]
            if world_size != rank_offset + sum(ranks):
                raise InvalidRequest(
                    f"world_size must be rank_offset + the pool's {sum(ranks)} ranks "
                    f"({len(ranks)} replicas) = {rank_offset + sum(ranks)}, got {world_size}"
                )
            offsets = [rank_offset + sum(ranks[:i]) for i in targets]
            results = await asyncio.gather(
                *(self.sup.call(
                    i, "init_weights_update_group", master_address, master_port, offsets[i],
                    world_size, group_name, backend, timeout_s,
                ) for i in targets),
                return_exceptions=True,
            )  # fmt: skip
            failed = {i: e for i, e in zip(targets, results) if isinstance(e, BaseException)}
            if failed:
                await self._leave(group_name, [i for i in targets if i not in failed])
                raise _refusal(failed, self.sup, f"the others left group {group_name!r}")
            self.groups[group_name] = Group(tuple(self.sup.incarnation))
            return {**results[0], "rank_offsets": offsets}

    async def destroy_group(self, group_name: str) -> dict:
        async with self.lock:
            self.groups.pop(group_name, None)
            errors = await self._leave(group_name, self.sup.up())
            if errors:
                raise errors[0]
            return {"success": True, "message": f"left {group_name!r}"}

    async def _leave(self, group_name: str, targets: list[int]) -> list[BaseException]:
        results = await asyncio.gather(
            *(self.sup.call(i, "destroy_weights_update_group", group_name)
              for i in targets),
            return_exceptions=True,
        )  # fmt: skip
        return [r for r in results if isinstance(r, BaseException)]

    def _group_members(self, group_name: str) -> list[int]:
        group = self.groups.get(group_name)
        if group is None:
            raise InvalidRequest(f"no open weight update group {group_name!r} on this pool")
        moved = [
            self.sup.replicas[i].name
            for i, inc in enumerate(group.incarnations)
            if inc != self.sup.incarnation[i] or i not in self.sup.up()
        ]
        if moved:
            raise WeightSyncError(
                f"{', '.join(moved)} restarted or went down since group {group_name!r} was "
                "formed: destroy_weights_update_group and init it again (the trainer too)"
            )
        return list(range(len(self.sup.replicas)))

    # ---- pause, memory, versions, cache ---------------------------------------------------------
    async def fan_out(
        self, method: str, *args: Any, among: list[int] | None = None,
        undo: Call | None = None, after_undo: Callable[[list[int]], Awaitable[None]] | None = None,
        **kwargs: Any,
    ) -> list:  # fmt: skip
        """`method` on every replica that is up (or `among`); on any failure, the undo of
        `method` (`undo`, else UNDO's) on those that did it, then `after_undo` of them, then
        the first failure is raised."""
        targets = self.sup.up() if among is None else among
        results = await asyncio.gather(
            *(self.sup.call(i, method, *args, **kwargs) for i in targets),
            return_exceptions=True,
        )
        failed = {i: e for i, e in zip(targets, results) if isinstance(e, BaseException)}
        if not failed:
            return list(results)
        undo = undo or UNDO.get(method)
        done = [i for i in targets if i not in failed]
        if undo is not None and done:
            back, back_args, back_kwargs = undo
            await asyncio.gather(
                *(self.sup.call(i, back, *back_args, **back_kwargs) for i in done),
                return_exceptions=True,
            )
            if after_undo is not None:
                await after_undo(done)
        for i, e in failed.items():
            if isinstance(e, ReplicaDead):
                self.sup.mark_dead(i, str(e))
        undone = f"undone on the others ({undo[0]})" if undo is not None else "not undone"
        raise _refusal(failed, self.sup, f"{method} was {undone}")

    async def pause(self, mode: str) -> dict:
        async with self.lock:
            await self.fan_out("pause_generation", mode=mode)
            self.paused = mode
            return {"success": True, "message": f"paused ({mode}) on every replica"}

    async def resume_generation(self) -> dict:
        async with self.lock:
            targets = self.sup.up()
            staged = self.staged_version
            self.paused = None
            if self.pending:
                adapters = dict(self.adapters.staged)
                await self._commit(targets, staged, adapters)
                self._applied(staged)
                await self._refresh_stale()
                out = {"success": True, "message": "generation continues"}
                out.update({"weight_version": staged} if staged is not None else {})
                return {**out, **({"lora_weight_versions": adapters} if adapters else {})}
            await self.fan_out("continue_generation", among=targets)
            return {"success": True, "message": "generation continues"}

    async def relabel(self, new_version: str, abort_all_requests: bool) -> dict:
        async with self.lock:
            await self.fan_out("update_weight_version", new_version, abort_all_requests)
            self._applied(new_version)  # the replicas committed what they staged, under it
            return {"success": True, "weight_version": new_version}

    async def memory(self, method: str, tags: tuple[str, ...]) -> dict:
        """release_memory_occupation or resume_memory_occupation of `tags` on every replica
        (undone on all if one fails); the pool keeps which tags are released, for a replica
        that restarts meanwhile."""
        async with self.lock:
            release = method == "release_memory_occupation"
            # The undo takes back what this call changed, not the tags released before it.
            changed = tuple(t for t in tags if (t in self.released) != release)
            back = "resume_memory_occupation" if release else "release_memory_occupation"
            undo = (back, (), {"tags": changed}) if changed else None
            results = await self.fan_out(method, tags=tags, undo=undo)
            if release:
                self.released.update(tags)
            else:
                self.released.difference_update(tags)
        return {**results[0], "replicas": len(results)} if results else {"success": True}

    async def restore(self, i: int) -> None:
        """Gives restarted replica i the pool's current weights and version, its adapters with
        their current values, then its pause with the updates staged since (staged.py) and the
        memory the others have released. A replica left stale is paused and released too: the
        pool's resume_memory_occupation reaches it, and its memory is the trainer's meanwhile."""
        async with self.lock:
            replica = self.sup.replicas[i]
            try:
                await self._bring_up(replica)
            except StaleWeights:
                await hold_as_the_others(replica, self.paused, [], self.released)
                raise
            await hold_as_the_others(replica, self.paused, self.pending, self.released)

    async def _bring_up(self, replica: Replica) -> None:
        """StaleWeights (before anything is pushed) when the pool lacks a copy of what it
        serves; the adapters' loads and values come after the base weights."""
        self.adapters.check_restorable()
        await self.source.restore(replica)
        await self.adapters.restore(replica)


# A replica call: the method, its positional and its keyword arguments.
Call = tuple[str, tuple, dict]
# The call that takes each call back, where a partial fan-out must not stay.
UNDO: dict[str, Call] = {
    "pause_generation": ("continue_generation", (), {}),
}


def _applied_as(result: Any, label: str | None, adapters: dict[str, str]) -> bool:
    """Did a replica's continue_generation apply its staged updates under these labels?"""
    if isinstance(result, BaseException):
        return False
    if label is not None and result.get("weight_version") != label:
        return False
    versions = result.get("lora_weight_versions") or {}
    return all(versions.get(name) == version for name, version in adapters.items())


def _refusal(failed: dict[int, BaseException], sup: Supervisor, consequence: str) -> Exception:
    """The first failure, raised again as its own kind, naming the replica and what the pool
    did about the others."""
    i, error = next(iter(failed.items()))
    others = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    message = f"{sup.replicas[i].name}{others}: {error}; {consequence}"
    if isinstance(error, RequestError):
        return type(error)(message)
    return WeightSyncError(message)
