"""SessionParams: which earlier turn of an open session a request continues (SGLang's names).

A request with session_params {"id": session, "rid": earlier, "offset": k, "replace": bool}
runs on the earlier turn's tokens (its prompt and output ids, cut to the first k when k > 0)
followed by its own input ids: nothing said before is tokenized again, and the earlier turn's
KV, which the session keeps in the prefix cache, is reused. Without "rid" the request starts a
new line of turns in the session. "replace": the turns that continued `rid` before (or, without
rid, every turn of the session) are forgotten first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from rollout.control import is_int
from rollout.errors import InvalidRequest, InvalidRequestType

if TYPE_CHECKING:  # messages.py holds SessionParams in each TokenizedRequest
    from rollout.engine.messages import TokenizedRequest

KEYS = ("id", "rid", "offset", "replace")


@dataclass(frozen=True)
class SessionParams:
    id: str
    rid: str | None = None  # the turn to continue; None: a new line of turns
    offset: int | None = None  # keep the first `offset` tokens of that turn (None or 0: all)
    replace: bool = False  # forget the turns that continued `rid` (without rid: every turn)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise InvalidRequestType(
                f"session_params.id must be a non-empty string, got {self.id!r}"
            )
        if self.rid is not None and not isinstance(self.rid, str):
            raise InvalidRequestType(
                f"session_params.rid must be a string or null, got {type(self.rid).__name__}"
            )
        if self.offset is not None and (not is_int(self.offset) or self.offset < 0):
            raise InvalidRequest(f"session_params.offset must be an int >= 0, got {self.offset!r}")
        if self.offset and self.rid is None:
            raise InvalidRequest("session_params.offset needs session_params.rid (the turn to cut)")
        if not isinstance(self.replace, bool):
            raise InvalidRequestType(
                f"session_params.replace must be a bool, got {type(self.replace).__name__}"
            )

    @classmethod
    def of(cls, value: Any) -> SessionParams:
        """From the dict a caller gives (null values mean the defaults)."""
        if isinstance(value, SessionParams):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestType(
                f"session_params must be a dict with keys {list(KEYS)}, got {type(value).__name__}"
            )
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise InvalidRequest(f"session_params has unknown keys {unknown}; known: {list(KEYS)}")
        if value.get("id") is None:  # null means the default, and id has none
            raise InvalidRequest("session_params needs an id (open_session returns one)")
        given = {k: v for k, v in value.items() if v is not None}
        return cls(**given)


def with_session(
    tokenizer: Any, session_params: Any, from_text: bool, inputs: list[TokenizedRequest]
) -> list[TokenizedRequest]:
    """The samples of a generate call that names session_params (one dict for one prompt, or
    one per prompt), each carrying its SessionParams. A text that continues a turn loses a
    leading BOS: it goes in the middle of the sequence, not at its start."""
    given = session_params if isinstance(session_params, list) else [session_params]
    if len(given) != len(inputs):
        raise InvalidRequest(
            f"session_params has {len(given)} entries for {len(inputs)} samples; a session turn "
            "takes n=1, and a batch one session_params per prompt"
        )
    bos = getattr(tokenizer, "bos_token_id", None)
    out = []
    for inp, value in zip(inputs, given):
        params = SessionParams.of(value)
        ids = inp.input_ids
        if from_text and params.rid is not None and bos is not None and ids[:1] == [bos]:
            ids = ids[1:]
        out.append(replace(inp, input_ids=ids, session_params=params))
    return out
