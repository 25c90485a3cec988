"""A token's own bytes: the piece of UTF-8 it adds to a text, even when that piece is only part of
a character (a byte-level BPE token, a sentencepiece byte-fallback token "<0xE4>"), which the
token's decoded text cannot show: decoding it alone gives U+FFFD."""

from __future__ import annotations

from rollout.engine.piece_bytes import REPLACEMENT, piece_bytes
from rollout.engine.token_text import TokenText


def token_bytes(text_of: TokenText, token_id: int, at_start: bool = False) -> bytes:
    """The bytes `token_id` adds to a decoded text (`at_start`: as its first token): its text's
    UTF-8 when that text is whole, else read from the token's vocabulary entry."""
    text = text_of.at_start(token_id) if at_start else text_of(token_id)
    if REPLACEMENT not in text:
        return text.encode()
    raw = piece_bytes(text_of.tokenizer.convert_ids_to_tokens(token_id))
    return text.encode() if raw is None else raw  # else a token whose text holds U+FFFD itself
