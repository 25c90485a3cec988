"""Triton's interpreter (TRITON_INTERPRET=1, how the kernels run on a CPU), made to swap in its
interpreted `triton.language` once a launch rather than at every call of a `@triton.jit`
helper.

The interpreter replaces the language's builtins with its own for the duration of a launch,
and again, by walking every member of `triton.language`, each time a kernel calls a jitted
helper (`pdl_start`, `weighted_norm`, `tl.sum` ...): on the engine's kernels that walk was a
third of their interpreted time. Here the launch swaps in the builtins of both
`triton.language` and `triton.language.core` (what a helper of this package or of Triton's
standard library reaches), and the helpers it calls find them in place. What each launch
computes is unchanged; after it the language is as before.

Relies on the interpreter's private `_patch_lang` and `GridExecutor`; where a Triton release
lacks them nothing is changed and the interpreter runs as shipped.
"""

from __future__ import annotations

import os
from typing import Any

_IDLE, _LAUNCHING, _SWAPPED = "idle", "launching", "swapped"


def interpreting() -> bool:
    """Whether Triton runs the kernels under its interpreter (TRITON_INTERPRET set and not 0)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class _Kept:
    """What a helper's call gets instead of a new swap: nothing to undo."""

    @staticmethod
    def restore() -> None:
        pass


def swap_once_a_launch() -> bool:
    """Installs the change (once per process); False where this Triton lacks what it needs."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    grid_executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or grid_executor is None:
        return False
    if getattr(grid_executor, "_swaps_once", False):
        return True
    state = [_IDLE]

    class _Language:  # what the launch swaps: both modules, whatever the kernel imported
        __globals__ = {"tl": tl, "core": tl.core}

    def swap(fn: Any) -> Any:
        if state[0] == _SWAPPED:  # a helper called inside a launch
            return _Kept
        if state[0] == _LAUNCHING:
            state[0] = _SWAPPED
            return patch_lang(_Language)
        return patch_lang(fn)

    launch = grid_executor.__call__

    def launch_swapping_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        state[0] = _LAUNCHING
        try:
            return launch(self, *args, **kwargs)
        finally:
            state[0] = _IDLE

    interpreter._patch_lang = swap
    grid_executor.__call__ = launch_swapping_once
    grid_executor._swaps_once = True
    return True
