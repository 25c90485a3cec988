"""The messages that cross process boundaries over ZMQ between our own processes.

tokenizer manager -> scheduler:   TokenizedRequest, ControlRequest (AbortRequest among its calls)
scheduler -> detokenizer:         ReqOutputBatch, ControlReply, SchedulerReady, SchedulerFailed
detokenizer -> tokenizer manager: the same, with `ReqOutput.text` filled in

Control traffic is plain data: a ControlRequest or ControlReply is two frames, CONTROL_TAG and
its JSON. Everything else is one pickled frame.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from rollout.control import ControlCall, check_bool
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.session_params import SessionParams
from rollout.errors import ControlError, InvalidRequest, InvalidRequestType

CONTROL_TAG = b"control"


@dataclass
class TokenizedRequest:
    """One sample to generate (`n` already expanded): prompt ids and options, built by
    request_validation.build_inputs. The tokenizer manager sets `rid` (where the caller gave
    none) and `seed` before it sends the request to the scheduler."""

    rid: str | None
    input_ids: list[int]
    params: SamplingParams
    seed: int | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None  # None: no prompt logprobs
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_hidden_states: bool = False
    stream: bool = False
    # Prefill only, answered with the pooled last-token output instead of sampled tokens.
    embed: bool = False
    normalize: bool = False  # embed: scale the embedding to unit L2 norm
    # Read by the tokenizer manager only, when it builds the caller's result:
    return_text_in_logprobs: bool = False
    # The tokens the context leaves after the prompt, where fewer than params.max_new_tokens.
    max_new_tokens_capped: int | None = None
    # A turn of an open session (session_params.py). The tokenizer manager puts the session's
    # earlier tokens before input_ids; the scheduler keeps the finished turn's KV cached.
    session_params: SessionParams | None = None
    # The LoRA adapter the request runs on, by name (None: the base model).
    lora_name: str | None = None
    # A sample of an n > 1 request: the rid the caller gave it (each sample's is rid-i), which
    # aborts every sample.
    group_rid: str | None = None


@dataclass(frozen=True)
class AbortRequest(ControlCall):
    """Ends one request (by rid), or every request; sent without waiting for a reply. With
    session_id (close_session): ends that session's requests and unpins its KV."""

    method: ClassVar[str] = "abort_request"
    rid: str | None = None
    abort_all: bool = False
    session_id: str | None = None

    def __post_init__(self) -> None:
        if self.rid is not None and not isinstance(self.rid, str):
            raise InvalidRequestType(f"rid must be a string, got {type(self.rid).__name__}")
        if self.session_id is not None and not isinstance(self.session_id, str):
            raise InvalidRequestType(
                f"session_id must be a string, got {type(self.session_id).__name__}"
            )
        if not check_bool(self.abort_all, "abort_all") and self.rid is None and not self.session_id:
            raise InvalidRequest("give rid, or abort_all: true")


@dataclass(frozen=True)
class ControlRequest:
    """A call answered in order with the requests around it; `call_id` None: no reply."""

    call_id: int | None
    call: ControlCall

    def to_frames(self) -> list[bytes]:
        wire = {"id": self.call_id, "call": self.call.method, "args": self.call.to_wire()}
        return [CONTROL_TAG, json.dumps(wire).encode()]

    @classmethod
    def from_frames(
        cls, frames: list[bytes], calls: dict[str, type[ControlCall]]
    ) -> ControlRequest:
        """`calls`: each call type by name (see engine/control_calls.CALLS)."""
        wire = json.loads(frames[1])
        return cls(wire["id"], calls[wire["call"]](**wire["args"]))

    @staticmethod
    def id_of(frames: list[bytes]) -> int | None:
        """The call id of a request that `from_frames` could not read (None: none to reply to)."""
        try:
            return json.loads(frames[1])["id"]
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class ControlReply:
    """The result of call `call_id` (plain JSON data), or its error. `last`: the scheduler's
    reply to shutdown; nothing follows it."""

    call_id: int
    result: Any = None
    error: ControlError | None = None
    last: bool = False

    def to_frames(self) -> list[bytes]:
        wire: dict[str, Any] = {"id": self.call_id, "result": self.result, "last": self.last}
        if self.error is not None:
            wire["error"] = self.error.to_wire()
        return [CONTROL_TAG, json.dumps(wire).encode()]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> ControlReply:
        wire = json.loads(frames[1])
        error = ControlError(**wire["error"]) if "error" in wire else None
        return cls(wire["id"], wire["result"], error, wire["last"])


def is_control(frames: list[bytes]) -> bool:
    """Whether a received message is control traffic (JSON), not a pickled message."""
    return len(frames) == 2 and frames[0] == CONTROL_TAG


@dataclass
class SchedulerReady:
    info: dict[str, Any]


@dataclass
class SchedulerFailed:
    """The scheduler died; `error` is its traceback, for the caller's log (clients get
    `public_error` of it). Every pending call fails."""

    error: str


@dataclass(frozen=True)
class DecodeParams:
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # The prompt's last tokens: the output's text is what it adds after them (a sentencepiece
    # word "▁is" adds " is" after text, where alone it decodes to "is").
    context_ids: tuple[int, ...] = ()


# A logprob entry as the scheduler sends it: (logprob, token id). The caller gets
# (logprob, token id, text or None) (see LogprobColumns.entries).
Entry = tuple[float, int]


@dataclass
class LogprobColumns:
    """One request's logprobs in SGLang's six columns, named as the keys of `meta_info`. Per
    position: the token's entry (None for a prompt's first token), the top-k entries, and the
    entries of the requested ids (token_ids_logprob)."""

    output_token_logprobs: list[Entry] = field(default_factory=list)
    output_top_logprobs: list[list[Entry] | None] = field(default_factory=list)
    output_token_ids_logprobs: list[list[Entry] | None] = field(default_factory=list)
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[Entry] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[list[Entry] | None] = field(default_factory=list)

    def add_token(self, token: Entry, top: list[Entry] | None, by_id: list[Entry] | None) -> None:
        """One generated position."""
        self.output_token_logprobs.append(token)
        self.output_top_logprobs.append(top)
        self.output_token_ids_logprobs.append(by_id)

    def add_prompt(self, tokens: list, tops: list, by_id: list) -> None:
        """Prompt positions, in order."""
        self.input_token_logprobs.extend(tokens)
        self.input_top_logprobs.extend(tops)
        self.input_token_ids_logprobs.extend(by_id)

    def extend(self, later: LogprobColumns) -> None:
        for f in fields(self):
            getattr(self, f.name).extend(getattr(later, f.name))

    def tail(self, starts: dict[str, int]) -> LogprobColumns:
        """The positions of each column from starts[its name] (0 if absent) on."""
        return LogprobColumns(**{f.name: getattr(self, f.name)[starts.get(f.name, 0) :] for f in fields(self)})

    def entries(self, text_of: Callable[[int], str] | None = None) -> dict[str, list]:
        """The columns as the caller gets them: each entry (logprob, id, text), text None
        unless `text_of` gives it."""
        *_, out = self.entries_in_parts(text_of)
        return out

    def entries_in_parts(
        self, text_of: Callable[[int], str] | None = None, part: int | None = None
    ) -> Iterator[dict[str, list] | None]:
        """`entries`, made about `part` entries at a time (None: all at once): yields None after
        each part, where a caller on an event loop can let it run, and the columns last."""
        part = part or 1 << 62

        def one(entry: tuple | None) -> tuple | None:
            if entry is None:
                return None
            return (entry[0], entry[1], None if text_of is None else text_of(entry[1]))

        out, made = {}, 0
        for f in fields(self):
            column, converted = getattr(self, f.name), []
            if f.name.endswith("_token_logprobs"):  # one entry a position
                for start in range(0, len(column), part):
                    chunk = column[start : start + part]
                    converted.extend([one(e) for e in chunk])
                    made += len(chunk)
                    if made >= part:
                        made = 0
                        yield None
            else:  # a list of entries (or None) a position
                for entries in column:
                    converted.append(None if entries is None else [one(e) for e in entries])
                    made += 1 + (len(entries) if entries else 0)
                    if made >= part:
                        made = 0
                        yield None
            out[f.name] = converted
        yield out


@dataclass
class ReqOutput:
    """What is new for one request since its last ReqOutput: ids, logprobs, hidden states and
    version changes are deltas; the counts, finish reason and version are as of now. The
    tokenizer manager extends the first output it gets with each later one."""

    rid: str
    new_ids: list[int]
    # {"type": "stop"|"length"|"abort", "matched": ...}; {"type": "error", "message": ...} when
    # serving this request failed (its request alone: the engine serves on).
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    logprobs: LogprobColumns | None = None  # requests with return_logprob
    hidden_states: list[list[float]] | None = None
    embedding: list[float] | None = None  # embed requests, on their final output
    # {"offset": k, "weight_version": v}: output tokens from k on came from version v's weights.
    weight_version_changes: list[dict[str, Any]] | None = None
    # On a request's first output only: how the detokenizer turns its ids into text.
    decode_params: DecodeParams | None = None
    # Filled in by the detokenizer:
    text: str = ""  # delta since the last ReqOutput

    def extend(self, later: ReqOutput) -> None:
        """Adds a later output of the same request: this one then holds everything so far."""
        self.new_ids.extend(later.new_ids)
        self.text += later.text
        for name in (
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "weight_version",
        ):
            setattr(self, name, getattr(later, name))
        self.embedding = later.embedding if later.embedding is not None else self.embedding
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = LogprobColumns()
            self.logprobs.extend(later.logprobs)
        if later.hidden_states:
            self.hidden_states = self.hidden_states or []
            self.hidden_states.extend(later.hidden_states)
        if later.weight_version_changes:
            self.weight_version_changes = self.weight_version_changes or []
            self.weight_version_changes.extend(later.weight_version_changes)


@dataclass
class ReqOutputBatch:
    outputs: list[ReqOutput]


# Two or more separators: "/tmp/x", "C:\Users\me", "a/b/c", not "1/2".
_PATH = re.compile(r"(?:[A-Za-z]:)?[\w.@+-]*(?:[\\/][\w.@+-]+){2,}[\\/]?")
_MAX_PUBLIC_CHARS = 300


def public_error(text: str) -> str:
    """What of an error message may reach a client: its last line (a traceback's is the
    exception itself), file paths masked, at most 300 characters. The whole text belongs in
    the log of the process that caught it."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = _PATH.sub("<path>", lines[-1] if lines else "unknown error")
    return line if len(line) <= _MAX_PUBLIC_CHARS else line[: _MAX_PUBLIC_CHARS - 3] + "..."


def failure_reason(during: str, exc: BaseException) -> dict[str, Any]:
    """The finish_reason of a request whose serving failed `during` (e.g. "its forward step")."""
    message = public_error(f"{during} failed: {type(exc).__name__}: {exc}")
    return {"type": "error", "message": message}
