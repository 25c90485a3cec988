"""What a replica that restarted meanwhile gets of the pool's held state: its pause, with the
updates the others staged since the pause, and the memory the pool has released.

A restarted replica gets the pool's committed weights, then the pool's pause; without the
updates the others staged since the pause it would hold none of them, and at the pool's
continue_generation apply nothing (it was restarted once more for that), or only those staged
after its return: a partial tensor update then left it serving other weights than the others
under the same label. Staged again, in order, under their labels, it applies at continue
what the others apply, and drops them where they drop them.
"""

from __future__ import annotations

from rollout.pool.replica import Replica
from rollout.pool.supervisor import StaleWeights

# An update as PoolWeights records it: (method, args, kwargs with its label, label, the CPU
# copy of a tensor update's tensors or None).
Update = tuple


async def hold_as_the_others(
    replica: Replica, paused: str | None, pending: list[Update], released: set[str]
) -> None:
    """Pauses `replica` as the pool is paused (mode `paused`; None: not paused) with `pending`
    staged again, and releases the `released` memory tags, also when the rest fails (a replica
    left stale gives its memory back too: the pool's resume reaches it)."""
    try:
        if paused is not None:
            await replica.call("pause_generation", mode=paused)
            await _restage(replica, pending)
    finally:
        if released:
            await replica.call("release_memory_occupation", tags=sorted(released))


async def _restage(replica: Replica, pending: list[Update]) -> None:
    """Stages `pending` on `replica` (paused), in order. StaleWeights, before anything is
    sent, when one cannot be sent again: a broadcast, or tensors the pool kept no copy of."""
    for method, _, _, _, copied in pending:
        if method == "update_weights_from_distributed":
            raise StaleWeights("an update_weights_from_distributed is staged on the others")
        if method == "update_weights_from_tensor" and copied is None:
            raise StaleWeights(
                "a tensor update staged on the others was not kept (keep_tensor_snapshot=False)"
            )
    for method, args, kwargs, _, copied in pending:
        if method == "update_weights_from_tensor":
            # The caller's handles are closed by now: its tensors go from the pool's copy.
            keep = ("flush_cache", "weight_version", "lora_name")
            await replica.call(method, copied, **{k: kwargs[k] for k in keep if k in kwargs})
        else:
            await replica.call(method, *args, **kwargs)
