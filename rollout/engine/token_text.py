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


class TokenText:
    """Token id -> the text it adds in the middle of a text, memoized (logprob lists repeat the
    same ids a lot)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.anchor, self.head = in_text_anchor(tokenizer)

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self._in_text(token_id)
        return text

    def _in_text(self, token_id: int) -> str:
        text = self.tokenizer.decode([*self.anchor, token_id])
        if text.startswith(self.head):
            return text[len(self.head) :]
        return self.at_start(token_id)

    def at_start(self, token_id: int) -> str:
        """Its text as the first token of a text (an echoed prompt's)."""
        return self.tokenizer.decode([token_id])
