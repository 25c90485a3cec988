"""One multi-turn rollout as a trainer needs it: every token id, which of them the policy
sampled, their logprobs and the weights that sampled them, aligned position by position.

`SessionRollout` runs the turns in an engine session (a RolloutEngine or a RolloutClient: the
same calls): each turn sends only its new ids (the prompt, a tool's result, the environment's
answer), the engine appends them to the session's tokens and KV, and the policy's output ids
are kept exactly as sampled. Nothing is ever re-tokenized, so the trajectory is the sequence
the policy saw. `run_turns` steps many rollouts in one generate call.

    with SessionRollout(engine) as rollout:
        out = rollout.turn(prompt_ids, {"max_new_tokens": 8})
        out = rollout.turn(tool_result_ids, {"max_new_tokens": 8})
        trajectory = rollout.trajectory
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CAPACITY = 1 << 30  # tokens per turn: the engine's context length bounds it anyway


@dataclass
class Trajectory:
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1: sampled by the policy; 0: the rest
    logprobs: list[float] = field(default_factory=list)  # the sampled token's; 0.0 off the mask
    # The weight version that sampled each policy token (an update in the middle of a request
    # splits its tokens between versions); None off the mask.
    weight_versions: list[str | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def policy_ids(self) -> list[int]:
        return [t for t, m in zip(self.token_ids, self.loss_mask) if m]

    def add_context(self, ids: Sequence[int]) -> None:
        """Tokens the policy did not sample (prompt, tool or environment tokens)."""
        self.token_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.weight_versions.extend([None] * len(ids))

    def add_output(self, result: dict[str, Any]) -> None:
        """A generate result's output ids (asked with return_logprob=True)."""
        ids = list(result["output_ids"])
        meta = result["meta_info"]
        entries = meta.get("output_token_logprobs")
        if entries is None:
            raise ValueError(
                "the result has no output_token_logprobs: generate with return_logprob=True"
            )
        if len(entries) != len(ids):
            raise ValueError(f"the result has {len(ids)} output ids but {len(entries)} logprobs")
        if [int(e[1]) for e in entries] != ids:
            raise ValueError("the result's logprob entries are not those of its output ids")
        self.token_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(float(e[0]) for e in entries)
        self.weight_versions.extend(output_versions(meta, len(ids)))


def output_versions(meta: dict[str, Any], count: int) -> list[str | None]:
    """The weight version of each of a result's `count` output tokens: from the spans of
    meta_info.weight_versions; without them (an older server), from the changes, the tokens
    before the first change None."""
    spans = meta.get("weight_versions")
    if spans:
        versions: list[str | None] = [None] * count
        for span in spans:
            start, end = span["start"], span["end"]
            versions[start:end] = [span["version"]] * (end - start)
        return versions
    changes = sorted(meta.get("weight_version_changes") or (), key=lambda c: c["offset"])
    if not changes:
        return [meta["weight_version"]] * count
    versions = [None] * count
    for i, change in enumerate(changes):
        end = changes[i + 1]["offset"] if i + 1 < len(changes) else count
        versions[change["offset"] : end] = [change["weight_version"]] * (end - change["offset"])
    return versions


class SessionRollout:
    """One rollout in its own engine session; `close` (or leaving the `with`) closes it."""

    def __init__(self, engine: Any, capacity_of_str_len: int = DEFAULT_CAPACITY) -> None:
        self.engine = engine
        self.session_id: str = engine.open_session(capacity_of_str_len)
        self.trajectory = Trajectory()
        self.last_rid: str | None = None  # the turn the next one continues
        self.closed = False

    def session_params(self) -> dict[str, Any]:
        return {"id": self.session_id, "rid": self.last_rid}

    def record(self, new_ids: Sequence[int], result: dict[str, Any]) -> None:
        """A turn's result: `new_ids` were sent, the engine ran on the trajectory plus them."""
        expected = len(self.trajectory) + len(new_ids)
        if result["meta_info"]["prompt_tokens"] != expected:
            raise RuntimeError(
                f"the engine ran the turn on {result['meta_info']['prompt_tokens']} tokens, not "
                f"the trajectory's {expected}: the session lost track of a turn"
            )
        self.trajectory.add_context(new_ids)
        self.trajectory.add_output(result)
        self.last_rid = result["meta_info"]["id"]

    def turn(self, new_ids: Sequence[int], sampling_params: dict[str, Any] | None = None) -> dict:
        """Sends `new_ids` after everything so far; the policy's output joins the trajectory."""
        return run_turns(self.engine, [self], [new_ids], [sampling_params or {}])[0]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.close_session(self.session_id)

    def __enter__(self) -> SessionRollout:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_turns(
    engine: Any, rollouts: Sequence[SessionRollout], new_ids: Sequence[Sequence[int]],
    sampling_params: Sequence[dict[str, Any]],
) -> list[dict]:  # fmt: skip
    """One turn of each rollout (their own sessions, all on `engine`) in one generate call:
    rollout i gets new_ids[i] and samples with sampling_params[i]. Returns the results."""
    if not len(rollouts) == len(new_ids) == len(sampling_params):
        raise ValueError(
            f"{len(rollouts)} rollouts, {len(new_ids)} inputs and {len(sampling_params)} "
            "sampling params: give one of each per rollout"
        )
    first: dict[int, int] = {}  # id(rollout) -> its first index
    for i, rollout in enumerate(rollouts):
        j = first.setdefault(id(rollout), i)
        if j != i:  # both turns would continue its last turn, and only one could be kept
            raise ValueError(
                f"rollout {j} is given twice (again at {i}): a rollout takes one turn per call"
            )
    if not rollouts:
        return []
    results = engine.generate(
        input_ids=[list(ids) for ids in new_ids],
        sampling_params=[dict(p) for p in sampling_params],
        return_logprob=True,
        session_params=[r.session_params() for r in rollouts],
    )
    for rollout, ids, result in zip(rollouts, new_ids, results):
        rollout.record(ids, result)
    return results
