"""What an update carries before any byte of it arrives: each tensor's HF name, shape and dtype.

Every update is checked as a whole against the model (`check_against_model`) before any
parameter changes, so a wrong name, shape or dtype fails with nothing loaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollout.errors import InvalidRequest, InvalidRequestType

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
MAX_NAME_LEN = 1024
MAX_DIMS = 8


@dataclass(frozen=True)
class WeightSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def parse_dtype(value: Any) -> torch.dtype:
    """A torch.dtype from itself or its name ("bfloat16", "torch.bfloat16")."""
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
        return DTYPES[value.removeprefix("torch.")]
    raise InvalidRequest(f"dtype must be one of {', '.join(DTYPES)}, got {value!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_shape(value: Any, name: str) -> tuple[int, ...]:
    ok = isinstance(value, (list, tuple)) and len(value) <= MAX_DIMS
    if not ok or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise InvalidRequest(
            f"shape of {name!r} must be a list of at most {MAX_DIMS} non-negative ints, got {value!r}"
        )
    return tuple(value)


def check_name(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_LEN:
        raise InvalidRequest(f"a weight name must be a non-empty string, got {value!r}")
    return value


def build_specs(names: Sequence[Any], dtypes: Sequence[Any], shapes: Sequence[Any]) -> list[WeightSpec]:
    """Specs from parallel lists (the distributed call's arguments); names must be unique."""
    for label, seq in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(seq, (list, tuple)):
            raise InvalidRequestType(f"{label} must be a list, got {type(seq).__name__}")
    if not len(names) == len(dtypes) == len(shapes):
        raise InvalidRequest(
            f"names, dtypes and shapes must have one entry per tensor, got "
            f"{len(names)}, {len(dtypes)} and {len(shapes)}"
        )
    if not names:
        raise InvalidRequest("an update needs at least one tensor, got none")
    specs = [
        WeightSpec(check_name(n), parse_shape(s, n), parse_dtype(d))
        for n, d, s in zip(names, dtypes, shapes)
    ]
    check_unique([s.name for s in specs])
    return specs


def check_unique(names: Sequence[str]) -> None:
    seen: set[str] = set()
    dup = [n for n in names if n in seen or seen.add(n)]
    if dup:
        raise InvalidRequest(
            f"each weight may appear once per update; repeated: {sorted(set(dup))[:5]}"
        )


def check_against_model(
    specs: Sequence[WeightSpec],
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
    is_ignored: Callable[[str], bool],
    exact_dtype: bool = True,
) -> list[WeightSpec]:
    """Raises ValueError naming every problem (up to a few of each kind) unless each spec is a
    weight the model has (`expected`: name -> (shape, dtype)) with its shape, and its dtype
    (any floating dtype when not `exact_dtype`: the load casts). Returns the specs to load:
    those the model ignores (rotary buffers, a tied head) are dropped."""
    unknown, shapes, dtypes, keep = [], [], [], []
    for spec in specs:
        if spec.name not in expected:
            if not is_ignored(spec.name):
                unknown.append(spec.name)
            continue
        shape, dtype = expected[spec.name]
        if spec.shape != tuple(shape):
            shapes.append(f"{spec.name} must be {list(shape)}, got {list(spec.shape)}")
        ok_dtype = spec.dtype == dtype if exact_dtype else spec.dtype.is_floating_point
        if not ok_dtype:
            want = dtype_name(dtype) if exact_dtype else "a floating dtype"
            dtypes.append(f"{spec.name} must be {want}, got {dtype_name(spec.dtype)}")
        keep.append(spec)
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} unknown weight name(s), e.g. {unknown[:3]}")
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es): {'; '.join(shapes[:3])}")
    if dtypes:
        hint = " (cast on the sending side to the engine's dtype)" if exact_dtype else ""
        problems.append(f"{len(dtypes)} dtype mismatch(es){hint}: {'; '.join(dtypes[:3])}")
    if problems:
        raise InvalidRequest("the update does not fit the model: " + "; ".join(problems))
    return keep
