"""A token's text: what it adds to a text it is part of. Decoded after another token, as in the
middle of a text: a sentencepiece word "▁is" adds " is" there, where alone it decodes to "is"
(its decoder drops a text's first space); for byte-level vocabularies both are the same."""

from __future__ import annotations

from typing import Any

from rollout.engine.piece_bytes import REPLACEMENT


def in_text_anchor(tokenizer: Any) -> tuple[list[int], str]:
    """The token others are decoded after (the text "a"'s, or another short text's), and its
    own text; ([], "") for a vocabulary that spells none of them, whose tokens are then decoded
    alone."""
    for text in ("a", "A", "0", "."):
        ids = tokenizer.encode(text, add_special_tokens=False)[-1:]
        head = tokenizer.decode(ids)
        if head and REPLACEMENT not in head:
            return ids, head
    return [], ""


def decode_options(params: Any) -> dict[str, bool]:
    """tokenizer.decode's options from a request's (SamplingParams or DecodeParams): the
    detokenizer's text and the stop checker's read the same."""
    return {
        "skip_special_tokens": params.skip_special_tokens,
        "spaces_between_special_tokens": params.spaces_between_special_tokens,
    }


def text_after(tokenizer: Any, before: list[int], ids: list[int], **decode_kw: bool) -> str | None:
    """The text `ids` add after the text of `before`: the two decoded together, less the text
    of `before` alone; None where decoding them together changes that text."""
    head = tokenizer.decode(before, **decode_kw)
    text = tokenizer.decode(before + ids, **decode_kw)
    return text[len(head) :] if text.startswith(head) else None


class TokenText:
    """Token id -> the text it adds in the middle of a text, memoized (logprob lists repeat the
    same ids a lot)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.anchor = in_text_anchor(tokenizer)[0]

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self._in_text(token_id)
        return text

    def _in_text(self, token_id: int) -> str:
        text = text_after(self.tokenizer, self.anchor, [token_id])
        return self.at_start(token_id) if text is None else text

    def at_start(self, token_id: int) -> str:
        """Its text as the first token of a text (an echoed prompt's)."""
        return self.tokenizer.decode([token_id])
