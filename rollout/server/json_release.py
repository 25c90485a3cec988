"""Freeing a large parsed body a piece at a time, on a worker thread.

Dropping the last reference to a list of ten million items frees them all in one C call, which
holds the GIL, and with it the server's event loop, throughout; and it happens wherever that
last reference goes: often on the loop, when a request's frames or its error are dropped.
release() empties the containers of a parsed body (lists, dicts, pydantic models) one bounded
piece at a time, so the GIL can pass between pieces. It only empties a container that nothing
else refers to (its reference count says so): a list the engine still holds, or one both the
body and its validated model hold, is left as it is until its other holder lets go.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

from pydantic import BaseModel

PIECE_ITEMS = 2**15  # freed in one C call: a small part of what the loop can wait

# References to a container popped off release's stack and held by nothing else: the local
# name and getrefcount's own argument.
_SOLE = 2


def release(values: list[Any]) -> None:
    """Empties values, a list whose items its caller holds nowhere else, and, depth first, the
    lists, dicts and pydantic models they hold that nothing else holds, each a piece at a time.
    What is left is freed as values' items are: small, or still held elsewhere."""
    stack = values
    while stack:
        obj = stack.pop()
        if sys.getrefcount(obj) != _SOLE:
            continue
        if type(obj) is list:
            _empty_list(obj, stack)
        elif type(obj) is dict:
            _empty_dict(obj, stack)
        elif isinstance(obj, BaseModel):
            _empty_dict(obj.__dict__, stack)
            if isinstance(obj.__pydantic_extra__, dict):
                _empty_dict(obj.__pydantic_extra__, stack)


def _empty_list(items: list[Any], stack: list[Any]) -> None:
    while items:
        piece = items[-PIECE_ITEMS:]
        del items[-PIECE_ITEMS:]
        # Containers with containers in them go on the stack, to be emptied in turn; dropping
        # piece frees the rest (scalars, and flat containers, which the collector untracks).
        stack += filter(gc.is_tracked, piece)
        del piece


def _empty_dict(members: dict[Any, Any], stack: list[Any]) -> None:
    while members:
        if len(members) <= PIECE_ITEMS:
            piece = list(members.values())
            members.clear()
        else:
            piece = [members.popitem()[1] for _ in range(PIECE_ITEMS)]
        stack += filter(gc.is_tracked, piece)
        del piece
