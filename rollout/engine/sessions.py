"""SessionBook: the open sessions and the token ids of their turns, in the tokenizer manager.

A session is a tree of turns (requests), each known by its rid. A turn's sequence is the
sequence of the turn it continues (cut at session_params.offset) followed by its own input
ids; once it finishes, its prompt and output ids are what later turns continue. All of it
runs on the tokenizer manager's event loop: no locks.

The KV of finished turns is kept in the scheduler's prefix cache (session_pins.py) until the
session closes, so a later turn reuses it; the book decides which tokens a turn runs on.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace

from rollout.control import is_int, nonempty_str
from rollout.engine.messages import TokenizedRequest
from rollout.engine.request_validation import validate_prompt_length
from rollout.errors import InvalidRequest
from rollout.text_checks import check_label


@dataclass
class Turn:
    parent: str | None
    ids: list[int] | None = None  # prompt + output ids once finished; None while it runs
    children: set[str] = field(default_factory=set)


@dataclass
class Session:
    # The most tokens a turn's sequence may hold (SGLang's capacity_of_str_len, in tokens).
    capacity: int
    turns: dict[str, Turn] = field(default_factory=dict)

    def forget(self, rid: str) -> None:
        """Drops turn `rid` and every turn that continued it."""
        turn = self.turns.pop(rid, None)
        if turn is None:
            return
        if turn.parent in self.turns:
            self.turns[turn.parent].children.discard(rid)
        for child in list(turn.children):
            self.forget(child)


class SessionBook:
    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}

    def open(self, capacity_of_str_len: int, session_id: str | None = None) -> str:
        """Opens a session; returns its id (`session_id`, or a fresh one)."""
        if not is_int(capacity_of_str_len) or capacity_of_str_len < 1:
            raise InvalidRequest(
                f"capacity_of_str_len must be an int >= 1 (the most tokens a turn may hold), "
                f"got {capacity_of_str_len!r}"
            )
        if session_id is not None:
            nonempty_str(session_id, "session_id")
            check_label(session_id, "session_id")  # open_session answers it
        session_id = session_id or uuid.uuid4().hex
        if session_id in self.sessions:
            raise InvalidRequest(f"session {session_id!r} is already open")
        self.sessions[session_id] = Session(capacity_of_str_len)
        return session_id

    def close(self, session_id: str) -> None:
        """Forgets the session. (Its running turns and its KV are the scheduler's to end.)"""
        self._session(session_id)
        del self.sessions[session_id]

    def begin_turn(self, treq: TokenizedRequest, context_length: int) -> TokenizedRequest:
        """`treq` (rid set, session_params given) with the whole sequence it runs on as its
        input ids; it is registered as a running turn. Raises InvalidRequest, changing
        nothing, if the session, the turn it continues or the model's context doesn't allow it."""
        params = treq.session_params
        assert params is not None and treq.rid is not None
        session = self._session(params.id)
        if treq.rid in session.turns:
            raise InvalidRequest(
                f"rid {treq.rid!r} is already a turn of session {params.id!r}; give each turn "
                "its own rid"
            )
        base = self._base(session, params.id, params.rid, params.offset)
        ids = base + treq.input_ids
        if len(ids) > session.capacity:
            raise InvalidRequest(
                f"the turn would hold {len(ids)} tokens, more than session {params.id!r}'s "
                f"capacity_of_str_len ({session.capacity})"
            )
        validate_prompt_length(len(ids), context_length)
        if params.replace:
            old = session.turns[params.rid].children if params.rid else session.turns.keys()
            for rid in list(old):
                session.forget(rid)
        session.turns[treq.rid] = Turn(params.rid)
        if params.rid is not None:
            session.turns[params.rid].children.add(treq.rid)
        return replace(treq, input_ids=ids)

    def end_turn(self, treq: TokenizedRequest, output_ids: list[int] | None) -> None:
        """The turn finished with `output_ids` (it can be continued), or failed or was cancelled
        (None: it is forgotten). A session closed meanwhile is left alone."""
        params = treq.session_params
        assert params is not None and treq.rid is not None
        session = self.sessions.get(params.id)
        if session is None or treq.rid not in session.turns:
            return
        if output_ids is None:
            session.forget(treq.rid)
        else:
            session.turns[treq.rid].ids = treq.input_ids + output_ids

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise InvalidRequest(
                f"session {session_id!r} is not open (open_session gives an id; a closed "
                "session can't be used again)"
            )
        return session

    @staticmethod
    def _base(session: Session, session_id: str, rid: str | None, offset: int | None) -> list[int]:
        """The tokens a turn continuing `rid` starts with."""
        if rid is None:
            return []
        turn = session.turns.get(rid)
        if turn is None:
            raise InvalidRequest(
                f"session {session_id!r} has no turn {rid!r} to continue (a finished request of "
                "this session, by its rid)"
            )
        if turn.ids is None:
            raise InvalidRequest(
                f"turn {rid!r} of session {session_id!r} is still running; continue it once it "
                "has finished"
            )
        if offset and offset > len(turn.ids):
            raise InvalidRequest(
                f"session_params.offset must be in [0, {len(turn.ids)}] (turn {rid!r} holds "
                f"{len(turn.ids)} tokens), got {offset}"
            )
        return turn.ids[:offset] if offset else list(turn.ids)
