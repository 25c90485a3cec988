"""A vocabulary entry's bytes, for the tokens whose decoded text can't show them: a token that is
only part of a UTF-8 character decodes alone to U+FFFD, but its entry spells its bytes — as bytes
(tiktoken's vocabularies), as a byte-fallback piece "<0xE4>" (sentencepiece), or in the
byte-level alphabet (GPT-2's BPE: "ä" stands for the byte 0xE4)."""

from __future__ import annotations

import re
from functools import cache
from typing import Any

REPLACEMENT = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def piece_bytes(piece: Any) -> bytes | None:
    """The bytes vocabulary entry `piece` (convert_ids_to_tokens's) stands for; None when it is
    spelled none of the ways above (an added token, a plain sentencepiece word)."""
    if isinstance(piece, bytes):
        return piece
    if not isinstance(piece, str) or not piece:
        return None
    if match := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(match[1], 16)])
    alphabet = _byte_level_alphabet()
    if all(ch in alphabet for ch in piece):
        return bytes(alphabet[ch] for ch in piece)
    return None


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> the byte it stands for: printable bytes stand
    for themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return alphabet
