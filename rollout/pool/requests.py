"""Splitting one `generate` call into one part per prompt, and putting the answers back.

A batch of prompts is spread over the replicas, one prompt (with all `n` of its samples, so a
GRPO group stays on one replica) per part, each routed on its own prompt. A part is the same
call for a batch of one prompt, so its answer is a list of its `n` samples; the caller gets
them back prompt-major, as one engine answers. A call whose shape is off (lists of unequal
length, no prompt) is not split: one replica answers it, with the engine's own error.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rollout.generate_request import GenerateRequest

DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams' default, for the load estimate only
TEXT_CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class Part:
    request: GenerateRequest
    key: list[int] | str | None  # what the router matches prefixes on
    rid: str | None  # what pins it to a replica: its session (session_pin), else its own rid
    tokens: int  # outstanding tokens it adds to a replica's load


def split(request: GenerateRequest) -> tuple[list[Part], bool]:
    """The parts, and whether the answers are joined into one list (False: the one part's
    answer is the answer, as it is)."""
    prompts = _prompt_list(request)
    if prompts is None or len(prompts) < 2 or not _lists_fit(request, len(prompts)):
        return [_part(request, _single_key(request))], False
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


def join(answers: list[Any]) -> list[dict]:
    """Each part's list of samples, concatenated in prompt order."""
    return [out for answer in answers for out in (answer if isinstance(answer, list) else [answer])]


def mark_retried(answer: Any) -> Any:
    """Sets meta_info["retried"] on every output of an answer that a second replica gave."""
    for out in answer if isinstance(answer, list) else [answer]:
        if isinstance(out, dict) and isinstance(out.get("meta_info"), dict):
            out["meta_info"]["retried"] = True
    return answer


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


def _single_key(request: GenerateRequest) -> list[int] | str | None:
    prompt = request.prompt if request.prompt is not None else request.input_ids
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(type(t) is int for t in prompt[:64]):
        return prompt
    return None


def _part(request: GenerateRequest, key: Any) -> Part:
    rid = request.rid[0] if isinstance(request.rid, list) and request.rid else request.rid
    session = session_of(request)
    pin = session_pin(session) if session is not None else rid if isinstance(rid, str) else None
    return Part(request, key, pin, _tokens(request, key))


def session_of(request: GenerateRequest) -> str | None:
    """The session a part's turn continues (its KV lives on the session's replica)."""
    params = request.session_params
    params = params[0] if isinstance(params, list) and len(params) == 1 else params
    session = params.get("id") if isinstance(params, dict) else None
    return session if isinstance(session, str) else None


def session_pin(session_id: str) -> str:
    """The router's pin of a session: every turn goes to the replica that opened it."""
    return f"session/{session_id}"


def _tokens(request: GenerateRequest, key: Any) -> int:
    """An estimate: an unsplit batch counts as its first prompt."""
    params = request.sampling_params
    params = (params[0] if params else {}) if isinstance(params, list) else params
    params = params if isinstance(params, dict) else {}
    new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    n = params.get("n", 1)
    new = new if isinstance(new, int) else DEFAULT_MAX_NEW_TOKENS
    n = n if isinstance(n, int) and n > 0 else 1
    prompt = len(key) // TEXT_CHARS_PER_TOKEN if isinstance(key, str) else len(key or ())
    return (prompt + max(new, 0)) * n
