"""The field every option dataclass declares its options with: a default and the help text the
CLI shows (rollout/config.py's engine options, rollout/lora_options.py, rollout/server/options.py)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with `default`, and `help` (and any other metadata) for the CLI."""
    return field(default=default, metadata={"help": help, **kw})
