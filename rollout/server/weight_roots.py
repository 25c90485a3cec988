"""Paths the server reads weights from (checkpoints, LoRA adapters): only under the
--allowed-weight-roots. The path is checked here, and the roots travel with the call so the
scheduler checks every file where it opens it (rollout.models.loader.open_checked)."""

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
