"""Paths weights are read from (checkpoints, LoRA adapters) under allowed roots (the server's
--allowed-weight-roots): the path given is checked here, where the call runs, and every file
opened under it again (rollout.models.loader.open_checked)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from rollout.errors import Forbidden, InvalidRequest


def path_under_roots(given: str, roots: Sequence[str], field: str) -> str:
    """`given` resolved (symlinks followed); Forbidden unless it lies under one of `roots`."""
    try:
        path = os.path.realpath(given)
    except ValueError as e:  # a NUL byte, or text that is no file name here
        raise InvalidRequest(f"{field} is not a usable path: {e}") from None
    for root in roots:
        real = os.path.realpath(root)
        if os.path.commonpath([path, real]) == real:
            return path
    allowed = ", ".join(roots) if roots else "none configured (start with --allowed-weight-roots DIR)"
    raise Forbidden(f"{field} {given!r} is not under an allowed root: {allowed}")
