"""Weight version labels: what `meta_info.weight_version` says.

A trainer names versions (`weight_version="step-12"`). An update that names none still changes
the weights, so the label changes too: "<last named version>+<updates since>", e.g.
"step-12+1" ("default+1" before any was named). Labels only ever name committed weights.
"""

from __future__ import annotations

from typing import Any

from rollout.errors import InvalidRequest

INITIAL = "default"
MAX_LEN = 256


def check_version(value: Any, what: str = "weight_version") -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_LEN:
        raise InvalidRequest(
            f"{what} must be a non-empty string of at most {MAX_LEN} characters, got {value!r}"
        )
    return value


class VersionLabels:
    def __init__(self, initial: str = INITIAL) -> None:
        self.named = initial
        self.unnamed = 0  # committed updates since `named` was set

    @property
    def current(self) -> str:
        return self.named if self.unnamed == 0 else f"{self.named}+{self.unnamed}"

    def publish(self, explicit: str | None) -> str:
        """The label for the weights just committed (or relabelled): `explicit`, or the next
        unnamed one."""
        if explicit is not None:
            self.named, self.unnamed = explicit, 0
        else:
            self.unnamed += 1
        return self.current
