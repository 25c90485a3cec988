"""LoRA adapters across the tensor-parallel ranks of one engine.

Every rank holds its slices of every adapter slot (rollout/models/lora_layer.py): a loaded
adapter must be loaded on every rank, under the same name, and an update must reach every
rank. Rank 0 decides; the other ranks run the handlers of `RankAdapters`, called by name
between steps (as the weight handlers of rank_weights.py are), and answer a failure as a
ControlError's wire form.

- Loading and unloading an adapter (rank 0's LoraManager, through `OtherRankAdapters`): rank
  0 loads first, then every other rank; if any refuses, the ranks that loaded unload again, so
  the adapter is loaded on every rank or on none.
- An update of an adapter's values (rank 0's AdapterUpdates) is two-phase: every rank receives
  the update whole and checks it, keeping it under an id (ADAPTER_LOAD); only once every rank
  has it does any write its slices (ADAPTER_APPLY, right away or at continue_generation when
  staged); otherwise every rank drops it (ADAPTER_DROP). Rank 0 and the others run the same
  checks on the same call, so they refuse alike.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rollout.control import ControlCall
from rollout.errors import ControlError, WeightSyncError

if TYPE_CHECKING:
    from rollout.weight_sync.adapter_update import AdapterUpdates
    from rollout.weight_sync.engine_port import AdapterPort
    from rollout.weight_sync.rank_sync import OtherRanks, RankAnswer

logger = logging.getLogger(__name__)

# The handlers every other rank registers, by the name rank 0 calls.
LORA_LOAD = "lora_load"  # (name, path, roots) -> {} | {"error"}: load a PEFT adapter directory
LORA_UNLOAD = "lora_unload"  # (name) -> {} | {"error"}
ADAPTER_LOAD = "adapter_update_load"  # (id, method, wire) -> {} | {"error"}: receive, keep
ADAPTER_APPLY = "adapter_update_apply"  # (ids) -> {} | {"error"}: write what was kept
ADAPTER_DROP = "adapter_update_drop"  # (ids or None: all) -> {}

Result = dict[str, Any]
Write = Callable[["AdapterPort"], object]


def answering(rank: int, name: str, fn: Callable[..., Result]) -> Callable[..., Result]:
    """`fn` as a rank's handler: a failure is answered as {"error": its wire form}."""

    def run(*args: Any) -> Result:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - every failure goes back to rank 0
            error = ControlError.of(e, "weight_sync")
            if error.kind in ("internal", "weight_sync"):
                logger.exception("tensor-parallel rank %d: %s failed", rank, name)
            return {"error": error.to_wire()}

    return run


def failures(answers: Sequence[RankAnswer], doing: str) -> dict[int, ControlError]:
    """Rank -> its failure, each naming the rank and what it was `doing`."""
    out = {}
    for answer in answers:
        error = None
        if answer.error is not None:
            error = ControlError("internal", answer.error)
        elif isinstance(answer.result, dict) and "error" in answer.result:
            error = ControlError(**answer.result["error"])
        if error is not None:
            message = f"tensor-parallel rank {answer.rank} failed {doing}: {error.message}"
            out[answer.rank] = ControlError(error.kind, message)
    return out


def _raise_first(failed: Mapping[int, ControlError]) -> None:
    if failed:
        raise failed[min(failed)].exception()


class OtherRankAdapters:
    """What rank 0 asks of the other ranks for adapters, with their answers checked."""

    def __init__(self, ranks: OtherRanks) -> None:
        self.ranks = ranks
        self._ids = itertools.count()
        self._pending: Callable[[], Sequence[RankAnswer]] | None = None

    # ---- loading and unloading ------------------------------------------------------------------
    def load(self, name: str, path: str, roots: Sequence[str] | None) -> None:
        """Loads the adapter on every other rank, or on none: raises the first rank's refusal
        once the ranks that loaded it have unloaded it again."""
        answers = self.ranks.call(LORA_LOAD, name, path, None if roots is None else list(roots))
        failed = failures(answers, f"loading LoRA adapter {name!r}")
        if failed and len(failed) < len(answers):  # some loaded it
            self.unload(name, quiet=True)
        _raise_first(failed)

    def unload(self, name: str, quiet: bool = False) -> None:
        """Unloads the adapter on every other rank (`quiet`: where it is loaded, ignoring the
        others' refusals)."""
        failed = failures(self.ranks.call(LORA_UNLOAD, name), f"unloading LoRA adapter {name!r}")
        if not quiet:
            _raise_first(failed)

    # ---- the two-phase update -------------------------------------------------------------------
    def start_load(self, call: ControlCall) -> int:
        """Sends update `call` to every other rank, which receive it while rank 0 does; its id."""
        update_id = next(self._ids)
        self._pending = self.ranks.start(ADAPTER_LOAD, update_id, call.method, call.to_wire())
        return update_id

    def check_loaded(self, update_id: int) -> None:
        """Waits for every other rank to have received the update; if any failed, every rank
        drops it, and the first failure is raised."""
        failed = failures(self._wait(), "receiving the LoRA adapter update")
        if failed:
            self.drop([update_id])
            _raise_first(failed)

    def abandon(self, update_id: int) -> None:
        """Rank 0 refused the update or failed to receive it: once the other ranks are done
        with it, they drop it (whatever they answered)."""
        try:
            self._wait()
        except WeightSyncError:
            pass  # the caller raises rank 0's own error
        self.drop([update_id])

    def writing_everywhere(self, update_id: int, write: Write) -> Write:
        """Rank 0's `write` of a received update, followed by every other rank's; dropped on
        the others when rank 0's write fails (its adapter was unloaded while staged)."""

        def run(port: AdapterPort) -> object:
            try:
                out = write(port)
            except Exception:
                self.drop([update_id])
                raise
            failed = failures(self.ranks.call(ADAPTER_APPLY, [update_id]), "writing an update")
            if failed:  # they checked it as rank 0 did: not expected
                raise WeightSyncError("; ".join(e.message for e in failed.values()))
            return out

        return run

    def drop(self, update_ids: Iterable[int]) -> None:
        self.ranks.call(ADAPTER_DROP, list(update_ids))

    def drop_all(self) -> None:
        self.ranks.call(ADAPTER_DROP, None)

    def _wait(self) -> Sequence[RankAnswer]:
        pending, self._pending = self._pending, None
        assert pending is not None, "no adapter update was sent to the other ranks"
        try:
            return pending()
        except Exception as e:  # noqa: BLE001 - a rank that does not answer fails the update
            raise WeightSyncError(f"tensor-parallel ranks did not answer: {e}") from e


class RankAdapters:
    """A rank other than 0: its side of every adapter call rank 0 makes. `updates` is this
    rank's AdapterUpdates (over its own EnginePort and LocalUpdates), used to receive and check
    updates; `calls` is every control call by method name, to rebuild the calls rank 0 sends."""

    def __init__(
        self, updates: AdapterUpdates, calls: Mapping[str, type[ControlCall]], rank: int
    ) -> None:
        self.updates = updates
        self.calls = calls
        self.rank = rank
        self.kept: dict[int, Write] = {}  # update id -> its write, received and checked

    def handlers(self) -> dict[str, Callable[..., Result]]:
        """Every handler by the name rank 0 calls it."""
        methods = {
            LORA_LOAD: self.load_adapter,
            LORA_UNLOAD: self.unload_adapter,
            ADAPTER_LOAD: self.load,
            ADAPTER_APPLY: self.apply,
            ADAPTER_DROP: self.drop,
        }
        return {name: answering(self.rank, name, fn) for name, fn in methods.items()}

    def _port(self) -> Any:
        adapters = self.updates.engine.adapters
        if adapters is None:
            raise WeightSyncError(f"tensor-parallel rank {self.rank} serves no LoRA adapters")
        return adapters

    def load_adapter(self, name: str, path: str, roots: list[str] | None) -> Result:
        self._port().load(name, path, roots)
        return {}

    def unload_adapter(self, name: str) -> Result:
        self._port().unload(name, ())  # no requests here: rank 0 checked its own
        return {}

    def load(self, update_id: int, method: str, wire: dict[str, Any]) -> Result:
        call = self.calls[method](**wire)
        with self.updates.received(call, keep=True) as write:
            self.kept[update_id] = write
        return {}

    def apply(self, update_ids: list[int]) -> Result:
        for update_id in update_ids:
            if update_id not in self.kept:
                raise WeightSyncError(f"no adapter update {update_id} was received on this rank")
            self.kept.pop(update_id)(self._port())
        return {}

    def drop(self, update_ids: list[int] | None) -> Result:
        if update_ids is None:
            self.kept.clear()
        for update_id in update_ids or ():
            self.kept.pop(update_id, None)
        return {}
