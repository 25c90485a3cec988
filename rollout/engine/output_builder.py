"""Accumulates a request's ReqOutputs into the SGLang-shaped dict users get back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout.engine.messages import ReqOutput
from rollout.engine.request_validation import GenerateInput

_LOGPROB_KEYS = (
    "output_token_logprobs",
    "output_top_logprobs",
    "output_token_ids_logprobs",
    "input_token_logprobs",
    "input_top_logprobs",
    "input_token_ids_logprobs",
)


@dataclass
class Accumulated:
    rid: str
    inp: GenerateInput
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    last: ReqOutput | None = None
    lists: dict[str, list] = field(default_factory=dict)
    embedding: list[float] | None = None


def _with_text(entry: Any) -> Any:
    """(logprob, id) -> (logprob, id, None); lists of them likewise; None stays None."""
    if entry is None:
        return None
    if isinstance(entry, tuple):
        return (entry[0], entry[1], None)
    return [(lp, tid, None) for lp, tid in entry]


def accumulate(acc: Accumulated, out: ReqOutput) -> None:
    acc.text += out.text
    acc.output_ids.extend(out.new_ids)
    acc.last = out
    if out.embedding is not None:
        acc.embedding = out.embedding
    for key in (*_LOGPROB_KEYS, "hidden_states", "weight_version_changes"):
        values = getattr(out, key)
        if values:
            acc.lists.setdefault(key, []).extend(values)


def build_output(acc: Accumulated, latency: float) -> dict[str, Any]:
    out = acc.last
    assert out is not None
    meta: dict[str, Any] = {
        "id": acc.rid,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "finish_reason": out.finish_reason,
        "weight_version": out.weight_version,
        # Where the weights changed under this request (updates while it ran): an entry
        # {"offset": k, "weight_version": v} means output_ids[k:] came from version v on.
        "weight_version_changes": acc.lists.get("weight_version_changes", []),
        "e2e_latency": latency,
    }
    if acc.inp.embed:
        # SGLang's shape for encode/classify: no text, no completion.
        for key in ("completion_tokens", "weight_version_changes"):
            meta.pop(key)
        return {"embedding": acc.embedding, "meta_info": meta}
    if acc.inp.max_new_tokens_capped is not None:
        # Not silent: the request asked for more tokens than the context leaves after the prompt.
        meta["max_new_tokens_capped"] = acc.inp.max_new_tokens_capped
    if acc.inp.return_logprob:
        for key in _LOGPROB_KEYS:
            meta[key] = [_with_text(e) for e in acc.lists.get(key, [])]
    if acc.inp.return_hidden_states:
        meta["hidden_states"] = acc.lists.get("hidden_states", [])
    return {"text": acc.text, "output_ids": list(acc.output_ids), "meta_info": meta}
