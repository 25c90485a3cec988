"""A request's outputs so far (one ReqOutput, extended) -> the SGLang-shaped dict users get."""

from __future__ import annotations

from typing import Any

from rollout.engine.messages import ReqOutput, TokenizedRequest


class TokenText:
    """Token id -> its text, memoized (logprob lists repeat the same ids a lot)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def build_output(
    total: ReqOutput, req: TokenizedRequest, latency: float, text_of: TokenText | None = None
) -> dict[str, Any]:
    """`total`: every output of `req` so far, extended into one. `text_of` fills in the text
    of each logprob entry (return_text_in_logprobs)."""
    meta: dict[str, Any] = {
        "id": total.rid,
        "prompt_tokens": total.prompt_tokens,
        "completion_tokens": total.completion_tokens,
        "cached_tokens": total.cached_tokens,
        "finish_reason": total.finish_reason,
        "weight_version": total.weight_version,
        # Where the weights changed under this request (updates while it ran): an entry
        # {"offset": k, "weight_version": v} means output_ids[k:] came from version v on.
        "weight_version_changes": list(total.weight_version_changes or ()),
        "e2e_latency": latency,
    }
    if req.embed:
        # SGLang's shape for encode/classify: no text, no completion.
        for key in ("completion_tokens", "weight_version_changes"):
            meta.pop(key)
        return {"embedding": total.embedding, "meta_info": meta}
    if req.max_new_tokens_capped is not None:
        # Not silent: the request asked for more tokens than the context leaves after the prompt.
        meta["max_new_tokens_capped"] = req.max_new_tokens_capped
    if req.return_logprob and total.logprobs is not None:
        meta.update(total.logprobs.entries(text_of if req.return_text_in_logprobs else None))
    if req.return_hidden_states:
        meta["hidden_states"] = list(total.hidden_states or ())
    return {"text": total.text, "output_ids": list(total.new_ids), "meta_info": meta}
