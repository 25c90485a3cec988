"""Splitting one `generate` call into one part per prompt, and putting the answers back.

A batch of prompts is spread over the replicas, one prompt (with all `n` of its samples, so a
GRPO group stays on one replica) per part, each routed on its own prompt. A part is the same
call for a batch of one prompt, so its answer is a list of its `n` samples; the caller gets
them back prompt-major, as one engine answers. A call whose shape is off (lists of unequal
length, no prompt) is not split: one replica answers it, with the engine's own error.

`rollout router` relays the body of a one-prompt /generate to a worker as the client sent it
(relay_part: the part's request is then those bytes), never parsed into a GenerateRequest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any

from rollout.generate_request import WIRE_NAMES, GenerateRequest

DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams' default, for the load estimate only
TEXT_CHARS_PER_TOKEN = 4
_WIRE_KEYS = frozenset(WIRE_NAMES.get(f.name, f.name) for f in fields(GenerateRequest))


@dataclass(frozen=True)
class Part:
    # bytes: a client's JSON body, relayed to a worker as it is (relay_part)
    request: GenerateRequest | bytes
    key: list[int] | str | None  # what the router matches prefixes on
    rid: str | None  # what pins it to a replica: its session (session_pin), else its own rid
    tokens: int  # outstanding tokens it adds to a replica's load


def split(request: GenerateRequest) -> tuple[list[Part], bool]:
    """The parts, and whether the answers are joined into one list (False: the one part's
    answer is the answer, as it is)."""
    prompts = _prompt_list(request)
    if prompts is None or len(prompts) < 2 or not _lists_fit(request, len(prompts)):
        return [_part(request, _single_key(request.prompt, request.input_ids))], False
    parts = []
    for i, prompt in enumerate(prompts):
        sub = replace(
            request,
            prompt=[prompt] if request.prompt is not None else None,
            input_ids=[prompt] if request.input_ids is not None else None,
            sampling_params=_nth(request.sampling_params, i),
            rid=[request.rid[i]] if isinstance(request.rid, list) else None,
            lora_path=_nth(request.lora_path, i),
            session_params=_nth(request.session_params, i),
        )
        parts.append(_part(sub, prompt))
    return parts, True


def relay_part(body: Any, raw: bytes) -> Part | None:
    """The part of a client's /generate body that a worker can be sent as it is (`raw`, parsed
    as `body`): one prompt, with its n samples, streamed only as one sample. None for what
    takes split's path, where the pool checks the request and sends it again: a batch, a
    streamed batch or n > 1 (the pool merges those streams), a body whose keys or flags are
    not GenerateRequest's (refused there)."""
    if not isinstance(body, dict) or not _WIRE_KEYS.issuperset(body):
        return None
    stream, log_metrics = body.get("stream", False), body.get("log_metrics", True)
    if type(stream) is not bool or type(log_metrics) is not bool or not _one_rid(body.get("rid")):
        return None
    prompt, ids, params = body.get("text"), body.get("input_ids"), body.get("sampling_params")
    key = _single_key(prompt, ids)
    if key is None:
        return None
    one_sample = (key is prompt or key is ids) and (params is None or _one_sample(params))
    if stream and not one_sample:
        return None
    return Part(raw, key, _pin(body.get("rid"), body.get("session_params")), _tokens(params, key))


def _one_rid(rid: Any) -> bool:
    """Whether `rid` may name one prompt's request: none, a string, or a list of one (the router
    claims it and pins on it; the app refuses any other)."""
    return rid is None or isinstance(rid, str) or (
        isinstance(rid, list) and len(rid) == 1 and isinstance(rid[0], str)
    )


def _one_sample(params: Any) -> bool:
    return isinstance(params, dict) and params.get("n", 1) in (1, None)


def join(answers: list[Any]) -> list[dict]:
    """Each part's list of samples, concatenated in prompt order."""
    return [out for answer in answers for out in (answer if isinstance(answer, list) else [answer])]


def mark_retried(answer: Any) -> Any:
    """Sets meta_info["retried"] on every output of an answer that a second replica gave."""
    for out in answer if isinstance(answer, list) else [answer]:
        if isinstance(out, dict) and isinstance(out.get("meta_info"), dict):
            out["meta_info"]["retried"] = True
    return answer


def json_retried(answer: bytes) -> bytes:
    """A worker's JSON answer with meta_info["retried"] set, as mark_retried does."""
    return _json(mark_retried(json.loads(answer)))


def events_retried(events: bytes) -> bytes:
    """A worker's server-sent events with meta_info["retried"] set on each output."""
    lines = events.split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(b"data:") and (data := line[5:].strip()) != b"[DONE]":
            lines[i] = b"data: " + _json(mark_retried(json.loads(data)))
    return b"\n".join(lines)


def _json(value: Any) -> bytes:
    # As the server writes it: non-finite floats (a -inf logprob) are values.
    return json.dumps(value, ensure_ascii=False, allow_nan=True, separators=(",", ":")).encode()


def _prompt_list(request: GenerateRequest) -> list | None:
    if request.prompt is not None and request.input_ids is None:
        return request.prompt if isinstance(request.prompt, list) else None
    ids = request.input_ids
    if request.prompt is None and isinstance(ids, list) and ids and isinstance(ids[0], list):
        return ids
    return None


def _lists_fit(request: GenerateRequest, count: int) -> bool:
    per_prompt = (request.sampling_params, request.rid, request.lora_path, request.session_params)
    if any(isinstance(given, list) and len(given) != count for given in per_prompt):
        return False
    return not request.stream  # a streamed batch stays whole: one replica streams it all


def _nth(params: Any, i: int) -> Any:
    return params[i] if isinstance(params, list) else params


def _single_key(prompt: Any, input_ids: Any) -> list[int] | str | None:
    prompt = prompt if prompt is not None else input_ids
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one (not a prompt of one token)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(type(t) is int for t in prompt[:64]):
        return prompt
    return None


def _part(request: GenerateRequest, key: Any) -> Part:
    pin = _pin(request.rid, request.session_params)
    return Part(request, key, pin, _tokens(request.sampling_params, key))


def _pin(rid: Any, session_params: Any) -> str | None:
    rid = rid[0] if isinstance(rid, list) and rid else rid
    session = session_of(session_params)
    return session_pin(session) if session is not None else rid if isinstance(rid, str) else None


def session_of(params: Any) -> str | None:
    """The session a part's turn continues (its KV lives on the session's replica), from its
    session_params."""
    params = params[0] if isinstance(params, list) and len(params) == 1 else params
    session = params.get("id") if isinstance(params, dict) else None
    return session if isinstance(session, str) else None


def session_pin(session_id: str) -> str:
    """The router's pin of a session: every turn goes to the replica that opened it."""
    return f"session/{session_id}"


def _tokens(params: Any, key: Any) -> int:
    """An estimate from the sampling params: an unsplit batch counts as its first prompt."""
    params = (params[0] if params else {}) if isinstance(params, list) else params
    params = params if isinstance(params, dict) else {}
    new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    n = params.get("n", 1)
    new = new if isinstance(new, int) else DEFAULT_MAX_NEW_TOKENS
    n = n if isinstance(n, int) and n > 0 else 1
    prompt = len(key) // TEXT_CHARS_PER_TOKEN if isinstance(key, str) else len(key or ())
    return (prompt + max(new, 0)) * n
