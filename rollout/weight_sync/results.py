"""SGLang's return shapes for the weight calls of the Python Engine API.

SGLang's `Engine` answers `init_weights_update_group`, `destroy_weights_update_group`,
`update_weights_from_distributed` and `update_weights_from_tensor` with `(success, message)` and
`update_weights_from_disk` with `(success, message, num_paused_requests)`. RolloutEngine answers
with those tuples too, as a `WeightCallResult`: its `info` is the engine's whole answer (the
dict the HTTP route returns: weight_version, staged, ...), and indexing it by key reads `info`,
so code written against the dict (`result["weight_version"]`, `dict(result)`) keeps working.

A failure still raises (ValueError, PermissionError, WeightSyncError: rollout/errors.py) where
SGLang would answer `(False, message)`: the weights and version are then as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, ItemsView, KeysView
from typing import Any


class WeightCallResult(tuple):
    """(success, message) or (success, message, num_paused_requests), with `info`: the whole
    answer. `result[0]`, unpacking and len are the tuple's; `result["key"]`, `get`, `keys`,
    `items` and `"key" in result` are info's."""

    info: dict[str, Any]

    def __new__(cls, values: tuple, info: dict[str, Any]) -> WeightCallResult:
        out = super().__new__(cls, values)
        out.info = dict(info)
        return out

    def __getnewargs__(self) -> tuple:  # pickles (Ray) as itself
        return (tuple(self), self.info)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return self.info[key]
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        return key in self.info if isinstance(key, str) else super().__contains__(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self.info.get(key, default)

    def keys(self) -> KeysView[str]:
        return self.info.keys()

    def items(self) -> ItemsView[str, Any]:
        return self.info.items()


def of(info: dict[str, Any], paused_count: bool = False) -> WeightCallResult:
    """SGLang's tuple for the engine's answer `info` (a success: failures raise)."""
    values: tuple = (bool(info.get("success", True)), str(info.get("message", "")))
    if paused_count:
        values += (int(info.get("num_paused_requests", 0)),)
    return WeightCallResult(values, info)


def sglang_shaped(method: Callable[..., Any], paused_count: bool = False) -> Callable[..., Any]:
    """`method` (a RolloutEngine weight call answering a dict) answering SGLang's tuple; its
    signature and doc are kept."""

    @functools.wraps(method)
    def shaped(self: Any, *args: Any, **kwargs: Any) -> WeightCallResult:
        out = method(self, *args, **kwargs)
        return out if isinstance(out, WeightCallResult) else of(out, paused_count)

    return shaped
