"""A request's outputs so far (one ReqOutput, extended) -> the SGLang-shaped dict users get."""

from __future__ import annotations

import asyncio
from typing import Any

from rollout.engine.messages import LogprobColumns, ReqOutput, TokenizedRequest
from rollout.engine.token_text import TokenText

# Logprob entries made between two turns of the event loop: a few ms of Python. A request's
# hundreds of thousands of entries (top_logprobs_num over a long prompt) made at once held the
# loop for 0.3 s on two CPU cores (tests/test_event_loop_latency.py).
LOOP_PART_ENTRIES = 16_384


class LogprobEntries:
    """One request's logprob entries as the caller gets them, each made once: an output makes
    only the positions new since the one before (a stream's outputs repeat every entry so far),
    in parts of LOOP_PART_ENTRIES with the event loop running between them."""

    def __init__(self, text_of: TokenText | None) -> None:
        self.text_of = text_of
        self.columns: dict[str, list] = {}

    async def update(self, logprobs: LogprobColumns) -> dict[str, list]:
        """The entries of every position of `logprobs` (which only ever grows), as new lists:
        each output dict is its caller's to keep."""
        made = {name: len(column) for name, column in self.columns.items()}
        for new in logprobs.tail(made).entries_in_parts(self.text_of, LOOP_PART_ENTRIES):
            if new is None:
                await asyncio.sleep(0)
        for name, entries in new.items():
            self.columns.setdefault(name, []).extend(entries)
        return {name: list(column) for name, column in self.columns.items()}


async def build_output_on_loop(
    total: ReqOutput, req: TokenizedRequest, latency: float, entries: LogprobEntries
) -> dict[str, Any]:
    """`build_output`, for a caller on the event loop: the logprob entries are made by
    `entries`, the request's own, kept across its outputs."""
    logprobs = None
    if req.return_logprob and total.logprobs is not None:
        logprobs = await entries.update(total.logprobs)
    return build_output(total, req, latency, entries.text_of, logprobs)


def build_output(
    total: ReqOutput,
    req: TokenizedRequest,
    latency: float,
    text_of: TokenText | None = None,
    logprobs: dict[str, list] | None = None,
) -> dict[str, Any]:
    """`total`: every output of `req` so far, extended into one. `text_of` fills in the text
    of each logprob entry (return_text_in_logprobs); `logprobs`, when given, are the entries
    already made from total.logprobs."""
    changes = total.weight_version_changes or ()
    meta: dict[str, Any] = {
        "id": total.rid,
        "prompt_tokens": total.prompt_tokens,
        "completion_tokens": total.completion_tokens,
        "cached_tokens": total.cached_tokens,
        "finish_reason": total.finish_reason,
        "weight_version": total.weight_version,
        # Where the weights changed under this request (updates while it ran): an entry
        # {"offset": k, "weight_version": v} means output_ids[k:] came from version v on.
        "weight_version_changes": [
            {"offset": c["offset"], "weight_version": c["weight_version"]} for c in changes
        ],
        # SGLang's view of the same: the labels over output positions [start, end).
        "weight_versions": version_spans(changes, total.weight_version, len(total.new_ids)),
        "e2e_latency": latency,
    }
    if req.embed:
        # SGLang's shape for encode/classify: no text, no completion.
        for key in ("completion_tokens", "weight_version_changes", "weight_versions"):
            meta.pop(key)
        return {"embedding": total.embedding, "meta_info": meta}
    if req.max_new_tokens_capped is not None:
        # Not silent: the request asked for more tokens than the context leaves after the prompt.
        meta["max_new_tokens_capped"] = req.max_new_tokens_capped
    if req.return_logprob and total.logprobs is not None:
        if logprobs is None:
            logprobs = total.logprobs.entries(text_of if req.return_text_in_logprobs else None)
        meta.update(logprobs)
    if req.return_hidden_states:
        meta["hidden_states"] = list(total.hidden_states or ())
    return {"text": total.text, "output_ids": list(total.new_ids), "meta_info": meta}


def version_spans(changes: Any, current: str, num_tokens: int) -> list[dict[str, Any]]:
    """SGLang's `meta_info.weight_versions`: [{"version", "start", "end"}] covering output
    positions [0, num_tokens) in order, neighbours with different labels, none empty (but the
    one span of an output with no tokens). `changes` are the scheduler's entries ({"offset",
    "weight_version", "previous"}), oldest first. An update that kept the label shows in the
    changes only."""
    version = changes[0].get("previous", current) if changes else current
    spans = [{"version": version, "start": 0, "end": num_tokens}]
    for change in changes:
        offset, label = min(change["offset"], num_tokens), change["weight_version"]
        last = spans[-1]
        if label == last["version"]:
            continue
        if offset == last["start"]:  # nothing came from the replaced version
            last["version"] = label
            if len(spans) > 1 and spans[-2]["version"] == label:
                spans.pop()
                spans[-1]["end"] = num_tokens
            continue
        if offset >= num_tokens:  # no token came from `label` (yet): no empty span for it
            continue
        last["end"] = offset
        spans.append({"version": label, "start": offset, "end": num_tokens})
    return spans
