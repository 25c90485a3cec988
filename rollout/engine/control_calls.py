"""The engine's own control calls, and every control call by name (for decoding the wire).

The weight-sync calls are rollout/weight_sync/calls.py's; abort is messages.AbortRequest, which
the scheduler also takes from inside (every control call: see rollout/control.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rollout.control import ControlCall
from rollout.engine.lora_calls import LORA_CALLS
from rollout.engine.messages import AbortRequest
from rollout.weight_sync.calls import WEIGHT_CALLS, GetWeightVersion


@dataclass(frozen=True)
class FlushCache(ControlCall):
    """Forget the prefix cache; refused (success False) while requests run."""

    method: ClassVar[str] = "flush_cache"


@dataclass(frozen=True)
class GetServerInfo(ControlCall):
    """The engine's options and state: the model, KV use, queues, the weight version, update
    groups and what memory is released."""

    method: ClassVar[str] = "get_server_info"


@dataclass(frozen=True)
class Shutdown(ControlCall):
    """The scheduler's last reply; the scheduler and the detokenizer exit after it."""

    method: ClassVar[str] = "shutdown"


# Calls that change nothing: answered between steps from the scheduler's host state (queues,
# KV use, counters, versions), with the step in flight left running. Every other call drains it.
READ_ONLY_CALLS: tuple[type[ControlCall], ...] = (GetServerInfo, GetWeightVersion)

CALLS: dict[str, type[ControlCall]] = {
    call.method: call
    for call in (FlushCache, GetServerInfo, Shutdown, AbortRequest, *WEIGHT_CALLS, *LORA_CALLS)
}
