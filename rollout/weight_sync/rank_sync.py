"""Weight calls across the tensor-parallel ranks of one engine: rank 0's side.

Rank 0 runs the WeightSyncController; each other rank holds its shard of the model and runs
the handlers of RankWeights (rank_weights.py), which rank 0 calls by name between steps over
the engine's line to them (`OtherRanks`, adapted in rollout/engine/weight_sync_port.py). An
update is two-phase: rank 0 sends the call to the other ranks first (so that every rank takes
a trainer's broadcast at once), loads it itself, then waits for every rank's answer. Each rank
loads into an open transaction with a backup; only when every rank loaded does any commit,
otherwise every rank rolls back to bitwise its old weights. Calls cross as their method name
and `to_wire()` JSON, never pickled; a rank's failure comes back as a ControlError's wire form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from rollout.control import ControlCall
from rollout.errors import ControlError, WeightSyncError
from rollout.forward.tensor_parallel import Shard

# The handlers every other rank registers (RankWeights.handlers), by the name rank 0 calls.
LOAD = "weights_load"  # (method, wire) -> {} | {"error"}: load the update, keep it open
COMMIT = "weights_commit"  # () -> {} | {"error"}: keep what is open
ROLL_BACK = "weights_roll_back"  # () -> {"lost": [names]} | {"error"}: restore the old values
JOIN = "weights_join"  # (wire of InitWeightsUpdateGroup) -> {} | {"error"}: start joining
JOINED = "weights_joined"  # (group_name) -> {} | {"error"}: wait for the join to end
LEAVE = "weights_leave"  # (group_name) -> {} | {"error"}
ROWS = "weights_rows"  # (hf_name, rows) -> {"shard": [dim, start, stop, full] or None, "rows"}
RELEASE = "memory_release"  # (tags) -> {} | {"error"}
RESUME = "memory_resume"  # (tags) -> {"weights_lost": bool} | {"error"}
HANDLERS = (LOAD, COMMIT, ROLL_BACK, JOIN, JOINED, LEAVE, ROWS, RELEASE, RESUME)


class RankAnswer(Protocol):
    """One rank's answer to a call (rollout.engine.tp_follower.RankReply has this shape)."""

    @property
    def rank(self) -> int: ...

    @property
    def result(self) -> Any:
        """What the handler returned."""
        ...

    @property
    def error(self) -> str | None:
        """Set when the handler raised instead of answering (a bug, or no such handler)."""
        ...


class OtherRanks(Protocol):
    """Rank 0's line to the engine's other tensor-parallel ranks (ranks 1 .. size - 1)."""

    @property
    def size(self) -> int:
        """The tensor-parallel size, rank 0 included."""
        ...

    def call(self, handler: str, *args: Any) -> Sequence[RankAnswer]:
        """Runs `handler(*args)` on every other rank (between their steps); their answers, in
        rank order. Raises if a rank does not answer."""
        ...

    def start(self, handler: str, *args: Any) -> Callable[[], Sequence[RankAnswer]]:
        """As `call`, but returns once the call is sent; the function returned waits for the
        answers. Nothing else may be asked of the ranks until it has been called."""
        ...


class OtherRankWeights:
    """What rank 0's weight calls ask of the other ranks, with their answers checked: a rank
    that failed raises the error of its kind, naming the rank."""

    def __init__(self, ranks: OtherRanks) -> None:
        self.ranks = ranks
        self.size = ranks.size
        self.open = False  # an update was sent and is neither committed nor rolled back
        self._pending: Callable[[], Sequence[RankAnswer]] | None = None

    # ---- the two-phase update ------------------------------------------------------------------
    def start_load(self, call: ControlCall) -> None:
        """Sends the update to every other rank; they load it while rank 0 does."""
        self.settle()
        self._pending = self.ranks.start(LOAD, call.method, call.to_wire())
        self.open = True

    def check_loaded(self) -> None:
        """Waits for every other rank's load; raises if any failed."""
        answers, self._pending = self._wait(), None
        _results(answers, "loading the update")

    def settle(self) -> None:
        """Waits for a load still under way, whatever its outcome (before any other call)."""
        if self._pending is not None:
            try:
                self._wait()
            except WeightSyncError:
                pass  # the caller is rolling back already
            finally:
                self._pending = None

    def commit(self) -> None:
        self.settle()
        self.open = False
        _results(self.ranks.call(COMMIT), "committing the update")

    def roll_back(self) -> list[str]:
        """Rolls every other rank back (once their loads ended); the weights some rank could
        not restore (written with no backup), by name."""
        self.settle()
        self.open = False
        lost: set[str] = set()
        for result in _results(self.ranks.call(ROLL_BACK), "rolling back"):
            lost.update(result["lost"])
        return sorted(lost)

    def _wait(self) -> Sequence[RankAnswer]:
        assert self._pending is not None
        try:
            return self._pending()
        except Exception as e:  # noqa: BLE001 - a rank that does not answer fails the update
            raise WeightSyncError(f"tensor-parallel ranks did not answer: {e}") from e

    # ---- update groups --------------------------------------------------------------------------
    def join(self, call: ControlCall) -> None:
        """Every other rank starts joining (the call's rank_offset + its rank)."""
        _results(self.ranks.call(JOIN, call.to_wire()), "joining")

    def joined(self, group_name: str) -> list[str]:
        """Waits for every other rank's join to end; each failure, naming its rank."""
        return _failures(self.ranks.call(JOINED, group_name), "joining")

    def start_leave(self, group_name: str) -> Callable[[], list[str]]:
        """Every other rank starts leaving; the function returned waits for them, giving each
        failure. Rank 0 leaves in between: an NCCL group's shutdown waits for all its ranks,
        so no rank may wait for its own before the others were asked."""
        self.settle()
        pending = self.ranks.start(LEAVE, group_name)
        return lambda: _failures(pending(), "leaving")

    # ---- reading and memory -------------------------------------------------------------------
    def gather_rows(
        self, name: str, view: torch.Tensor, shard: Shard, full: tuple[int, ...], rows: int
    ) -> torch.Tensor:
        """The first `rows` rows of the full tensor `name` (of shape `full`), on the host: rank
        0's `view` (its slice `shard`) joined with every other rank's part of those rows."""
        rows = min(rows, full[0])
        out = torch.empty((rows, *full[1:]), dtype=view.dtype)
        _place(out, shard, rows_of(view, shard, rows).cpu())
        for result in _results(self.ranks.call(ROWS, name, rows), "reading a weight"):
            got = result["shard"]
            _place(out, None if got is None else Shard(*got), result["rows"])
        return out

    def release(self, tags: list[str]) -> None:
        _results(self.ranks.call(RELEASE, tags), "releasing memory")

    def resume(self, tags: list[str]) -> bool:
        """Resumes `tags` on every other rank; whether any of them lost its weights' values."""
        results = _results(self.ranks.call(RESUME, tags), "resuming memory")
        return any(r["weights_lost"] for r in results)


def rows_of(view: torch.Tensor, shard: Shard | None, rows: int) -> torch.Tensor:
    """The part of a rank's view (its slice `shard` of a full tensor) that lies in the full
    tensor's first `rows` rows."""
    if shard is None or shard.dim != 0:
        return view[:rows]
    return view[: max(0, min(rows - shard.start, shard.size))]


def _place(out: torch.Tensor, shard: Shard | None, rows: torch.Tensor) -> None:
    if shard is None:
        out.copy_(rows[: len(out)])
    elif shard.dim == 0:
        out[shard.start : shard.start + len(rows)] = rows
    else:
        out.narrow(shard.dim, shard.start, shard.size).copy_(rows)


def _failures(answers: Sequence[RankAnswer], doing: str) -> list[str]:
    """Each failed rank's error, as `tensor-parallel rank R failed {doing}: {message}`."""
    out = []
    for answer in answers:
        error = _error_of(answer)
        if error is not None:
            out.append(f"tensor-parallel rank {answer.rank} failed {doing}: {error.message}")
    return out


def _results(answers: Sequence[RankAnswer], doing: str) -> list[Any]:
    """Every rank's result; raises the first rank's failure as the exception of its kind."""
    for answer in answers:
        error = _error_of(answer)
        if error is not None:
            message = f"tensor-parallel rank {answer.rank} failed {doing}: {error.message}"
            raise ControlError(error.kind, message).exception()
    return [answer.result for answer in answers]


def _error_of(answer: RankAnswer) -> ControlError | None:
    if answer.error is not None:
        return ControlError("internal", answer.error)
    if isinstance(answer.result, dict) and "error" in answer.result:
        return ControlError(**answer.result["error"])
    return None
