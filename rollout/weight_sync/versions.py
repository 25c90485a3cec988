"""Weight version labels: what `meta_info.weight_version` says.

A trainer names versions (`weight_version="step-12"`). As in SGLang, an update that names none
keeps the current label: the label says which version the trainer last named, not how many
updates happened. What tells two sets of weights apart under one label is the scheduler's
count of weight changes (`weight_updates` in get_server_info) and, inside one request, its
`weight_version_changes`, which list every update that happened while it ran, named or not.
Labels only ever name committed weights.
"""

from __future__ import annotations

from typing import Any

from rollout.errors import InvalidRequest
from rollout.text_checks import check_label

INITIAL = "default"
MAX_LEN = 256


def check_version(value: Any, what: str = "weight_version") -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_LEN:
        raise InvalidRequest(
            f"{what} must be a non-empty string of at most {MAX_LEN} characters, got {value!r}"
        )
    check_label(value, what)  # every output carries it: no lone surrogates, no control chars
    return value


class VersionLabels:
    def __init__(self, initial: str = INITIAL) -> None:
        self.current = initial

    def publish(self, explicit: str | None) -> str:
        """The label for the weights just committed (or relabelled): `explicit`, or the
        current one kept."""
        if explicit is not None:
            self.current = explicit
        return self.current
