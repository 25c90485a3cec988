"""A token's own bytes: the piece of UTF-8 it adds to a text, even when that piece is only part of
a character (a byte-level BPE token, a sentencepiece byte-fallback token "<0xE4>"), which the
token's decoded text cannot show: decoding it alone gives U+FFFD."""

from __future__ import annotations

import re
from functools import cache

from rollout.engine.output_builder import TokenText

REPLACEMENT = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> the byte it stands for: printable bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return alphabet


def token_bytes(text_of: TokenText, token_id: int) -> bytes:
    """The bytes `token_id` adds to a decoded text: its text's UTF-8 when that text is whole,
    else read from the token's vocabulary entry, as the byte-level and byte-fallback decoders do.
    """
    text = text_of(token_id)
    if REPLACEMENT not in text:
        return text.encode()
    piece = text_of.tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, bytes):  # tiktoken-style vocabularies hold the bytes themselves
        return piece
    if isinstance(piece, str) and piece:
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match[1], 16)])
        alphabet = _byte_level_alphabet()
        # NOTE: the rule of the byte-level decoder itself: a token of alphabet characters only
        # stands for their bytes; any other token (an added one) for its own UTF-8.
        if all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
    return text.encode()  # a token whose text holds U+FFFD itself
