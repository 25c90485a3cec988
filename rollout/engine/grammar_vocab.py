"""The vocabulary as a grammar must see it: each token id's bytes exactly as an output's text gets
them, the tokenizer decoding it (as rollout.engine.detokenizer does).

xgrammar can read a Hugging Face tokenizer itself (TokenizerInfo.from_huggingface), but it
guesses the tokens' encoding (byte-level, byte-fallback or raw) from the serialized decoder and
the look of the vocabulary, and a wrong guess lets a grammar allow a token whose real text
breaks it: a byte-level vocabulary that also holds "<0x07>"-style pieces passes for
byte-fallback, its "ć" (the byte 0x07) for the letter ć, and a JSON string takes a raw control
character. It also reads special tokens as their literal text, which an output that skips them
never shows. Decoding every token with the tokenizer leaves nothing to guess.
"""

from __future__ import annotations

from typing import Any

from rollout.engine.piece_bytes import REPLACEMENT, piece_bytes
from rollout.engine.token_text import in_text_anchor


def vocab_bytes(tokenizer: Any, vocab_size: int, skip_special_tokens: bool) -> list[bytes]:
    """[vocab_size] the bytes each id adds to an output's text, read in the middle of a text
    (after another token: a leading space that a decoder strips at the start still counts).
    b"" for an id that adds nothing: a special token when outputs skip them, an id past the
    tokenizer, a token whose bytes can't be told; xgrammar never allows those, bar stop ids.

    A token that is only part of a UTF-8 character decodes to U+FFFD: its bytes are read from
    its vocabulary entry (tiktoken's bytes, a byte-fallback "<0xE4>", byte-level "ä") and kept
    only if they decode to the same text."""
    # Not len(tokenizer): some vocabularies skip ids.
    known = min(vocab_size, max(tokenizer.get_vocab().values()) + 1)
    # Each token is decoded after an "a", as in the middle of a text.
    anchor, head = in_text_anchor(tokenizer)
    texts = tokenizer.batch_decode(
        [[*anchor, i] for i in range(known)], skip_special_tokens=skip_special_tokens
    )
    table = []
    for i, text in enumerate(texts):
        text = text[len(head) :] if text.startswith(head) else ""
        if REPLACEMENT in text:
            table.append(_piece_bytes(tokenizer.convert_ids_to_tokens(i), text))
        else:
            table.append(text.encode())
    return table + [b""] * (vocab_size - known)


def _piece_bytes(piece: Any, text: str) -> bytes:
    """The bytes of vocabulary entry `piece`, which decodes to `text`; b"" when its encoding is
    none of those known here or its bytes don't decode to `text`."""
    raw = piece_bytes(piece)
    return raw if raw is not None and raw.decode("utf-8", "replace") == text else b""
