"""ControlCall: each control call (flush, abort, server info, every weight, memory, version and
pause call) is one frozen dataclass, checked once, in `__post_init__`, where it is built.

`RolloutEngine`, `RolloutClient` and the HTTP routes are thin layers that build the call from
their arguments; the scheduler process dispatches on its type. A call crosses processes as
plain data, `{"call": method, "args": to_wire()}`, and `type(call)(**args)` builds it again:
nothing of it is ever pickled.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

from rollout.errors import InvalidRequest, InvalidRequestType


@dataclass(frozen=True)
class ControlCall:
    method: ClassVar[str]  # the engine's and the client's method, the HTTP path, the wire tag

    def to_wire(self) -> dict[str, Any]:
        """The arguments as JSON values (tuples become lists)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}


def control_method(call: type[ControlCall]) -> Callable[..., Any]:
    """A method that takes `call`'s fields as arguments and returns `self.control(call(...))`:
    the engine's and the client's method of that call, its signature and doc from the call."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self.control(call(*args, **kwargs))

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("self", kind)]
    for f in fields(call):
        default = inspect.Parameter.empty if f.default is MISSING else f.default
        params.append(inspect.Parameter(f.name, kind, default=default, annotation=f.type))
    method.__signature__ = inspect.Signature(params, return_annotation="dict")  # type: ignore[attr-defined]
    method.__name__ = method.__qualname__ = call.method
    method.__doc__ = call.__doc__
    return method


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def settle(call: ControlCall, name: str, value: Any) -> None:
    """Stores the checked (normalized) value of a field, from `__post_init__` of a frozen call."""
    object.__setattr__(call, name, value)


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestType(f"{name} must be a bool, got {type(value).__name__}")
    return value


def is_int(value: Any) -> bool:
    """An int that is not a bool (`True` as a count is a bug in the caller, not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def nonempty_str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{what} must be a non-empty string, got {value!r}")
    return value
