"""Engine output dicts -> OpenAI response pieces (choices, logprobs, usage)."""

from __future__ import annotations

import codecs
from typing import Any

from rollout.engine.token_text import TokenText
from rollout.server.token_bytes import token_bytes

# The most bytes of a character that can wait for the next token's (UTF-8's longest is four).
_UNFINISHED_BYTES = 3


def finish_reason(meta: dict) -> str | None:
    reason = meta.get("finish_reason")
    return None if reason is None else reason["type"]


def matched_stop(meta: dict) -> Any:
    reason = meta.get("finish_reason") or {}
    return reason.get("matched")


def completion_logprobs(
    meta: dict, text_of: TokenText, start: int, offset0: int
) -> tuple[dict, int]:
    """Legacy completions logprobs of output tokens [start:], text offsets counted from offset0,
    and the offset after the last of them (where a stream's next tokens begin: not the length
    of the text shown so far, which a stop string may hold back)."""
    entries = meta.get("output_token_logprobs", [])
    return _legacy_logprobs(entries, meta.get("output_top_logprobs"), text_of, start, offset0)


def _legacy_logprobs(
    entries: list,
    tops: list | None,
    text_of: TokenText,
    start: int,
    offset: int,
    text_start: bool = False,
) -> tuple[dict, int]:
    """The legacy completions logprobs object of entries[start:] ((logprob, id, text) each)
    and their top-logprob lists, text offsets counted from `offset`; and the offset after them.

    An offset is where the token begins in the text its bytes and those before decode to (as
    the tokenizer decodes them: invalid bytes as U+FFFD), in characters: a character split over
    tokens counts once, and each of its tokens begins where it does (`offset` itself stops
    before a character begun by entries[:start], which a text shows only once it is whole).
    `text_start`: entries[0] is the text's first token (an echoed prompt's), whose text is what
    it decodes to alone."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    tops = tops or []
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(_bytes_before(entries, text_of, start))  # an unfinished character's, if any
    for i, (lp, tid, _) in enumerate(entries[start:], start):
        first = text_start and i == 0
        text = text_of.at_start(tid) if first else text_of(tid)
        tokens.append(text)
        token_logprobs.append(lp)
        offsets.append(offset)
        offset += len(decoder.decode(token_bytes(text_of, tid, at_start=first)))
        best = tops[i] if i < len(tops) and tops[i] else []
        top.append({text_of(t): v for v, t, _ in best} if best else None)
    logprobs = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
    return logprobs, offset


def _bytes_before(entries: list, text_of: TokenText, start: int) -> bytes:
    """The last bytes of entries[:start]: enough to hold an unfinished character's first ones."""
    tail = b""
    for i in range(start - 1, -1, -1):
        if len(tail) >= _UNFINISHED_BYTES:
            break
        tail = token_bytes(text_of, entries[i][1]) + tail
    return tail[-_UNFINISHED_BYTES:]


def chat_logprobs(meta: dict, text_of: TokenText, start: int) -> dict:
    """Chat logprobs ({"content": [...]}) of output tokens [start:]. Each token's `bytes` are its
    own, part of a character's when it holds only that (its `token` text is then U+FFFD): the
    tokens' bytes joined are the content's UTF-8."""
    content = []
    tops = meta.get("output_top_logprobs") or []
    for i, (lp, tid, _) in enumerate(meta.get("output_token_logprobs", [])[start:], start):
        entries = tops[i] if i < len(tops) and tops[i] else []
        content.append(
            {
                "token": text_of(tid),
                "logprob": lp,
                "bytes": list(token_bytes(text_of, tid)),
                "top_logprobs": [
                    {"token": text_of(t), "logprob": v, "bytes": list(token_bytes(text_of, t))}
                    for v, t, _ in entries
                ],
            }
        )
    return {"content": content}


def usage(outputs: list[dict], n: int) -> dict:
    """Prompt tokens count once per prompt (outputs are prompt-major, n per prompt); cached tokens
    are those of each prompt's first sample, as a single request would see them."""
    firsts = [o["meta_info"] for o in outputs[::n]]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)},
    }


def prompt_logprobs(meta: dict, text_of: TokenText) -> dict:
    """Legacy completions logprobs of the prompt's tokens (echo with logprobs), offsets from 0:
    the first token has no logprob (nothing comes before it)."""
    entries = meta.get("input_token_logprobs") or []
    return _legacy_logprobs(entries, meta.get("input_top_logprobs"), text_of, 0, 0, True)[0]


def join_logprobs(first: dict, then: dict) -> dict:
    """Two legacy logprobs blocks, one after the other (the prompt's, then the completion's)."""
    return {key: first[key] + then[key] for key in first}


def version_metadata(meta: dict) -> dict:
    """SGLang's `metadata` block of an OpenAI response: the weight version (and its spans over
    the output) of the first choice."""
    out = {"weight_version": meta.get("weight_version")}
    if "weight_versions" in meta:
        out["weight_versions"] = meta["weight_versions"]
    return out
