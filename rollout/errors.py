"""The errors a caller of rollout can be answered with, and their kinds.

A request the caller got wrong raises a `RequestError` (the Python type stays the built-in one
callers catch: `InvalidRequest` is a ValueError, `InvalidRequestType` a TypeError, `Forbidden`
a PermissionError); the server answers those, and only those, with a 4xx. Anything else that
escapes is a bug or a failure of ours: a 500 (or a 502 for a failed weight transfer), with the
trace in the log. A control call's failure crosses processes as a `ControlError` (kind and
message, plain data) and is raised again from its kind (`ControlError.exception`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


class RequestError(Exception):
    """The caller's request was refused; the message says what was wrong and what would be
    right. `kind` names it across processes and picks the HTTP status (see server/responses)."""

    kind: ClassVar[str] = "invalid"


class InvalidRequest(RequestError, ValueError):
    """An argument has a wrong value."""


class InvalidRequestType(RequestError, TypeError):
    """An argument has a wrong type."""


class Forbidden(RequestError, PermissionError):
    """The request may not do this (a checkpoint file outside the allowed weight roots)."""

    kind: ClassVar[str] = "forbidden"


class ServerUnreachable(ConnectionError):
    """RolloutClient could not connect to its server, or lost the connection mid-answer; the
    message names the server's URL and the route."""


class WeightSyncError(RuntimeError):
    """A weight transfer failed (the peer died, timed out, or sent something unusable)."""


# Each kind as a Python exception, and as an HTTP answer (status, the error body's "type"):
# the engine and the client raise the first, the server answers the second.
EXCEPTIONS: dict[str, type[Exception]] = {
    "invalid": InvalidRequest,
    "forbidden": Forbidden,
    "weight_sync": WeightSyncError,
    "internal": RuntimeError,
}
HTTP: dict[str, tuple[int, str]] = {
    "invalid": (400, "invalid_request_error"),
    "forbidden": (403, "permission_error"),
    "weight_sync": (502, "weight_sync_error"),
    "internal": (500, "server_error"),
}


def kind_of(error: BaseException, otherwise: str = "internal") -> str:
    """The kind a failure is reported as: the caller's mistake, a failed transfer, or
    `otherwise` (anything we did not expect)."""
    if isinstance(error, RequestError):
        return error.kind
    if isinstance(error, WeightSyncError):
        return "weight_sync"
    return otherwise


@dataclass(frozen=True)
class ControlError:
    """A control call's failure, as plain data: `kind` is a key of EXCEPTIONS."""

    kind: str
    message: str

    def __post_init__(self) -> None:
        if self.kind not in EXCEPTIONS:
            raise ValueError(f"error kind must be one of {', '.join(EXCEPTIONS)}, got {self.kind!r}")

    @classmethod
    def of(cls, error: BaseException, otherwise: str = "internal") -> ControlError:
        message = str(error) if kind_of(error, "") else f"{type(error).__name__}: {error}"
        return cls(kind_of(error, otherwise), message)

    def exception(self) -> Exception:
        return EXCEPTIONS[self.kind](self.message)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message}
