"""Checks on the text of names and labels that come from outside (session, adapter and weight
version names, prompt text): encodable as UTF-8, and for names free of control characters."""

from __future__ import annotations

import unicodedata

from rollout.errors import InvalidRequest


def check_unicode(text: str, what: str) -> None:
    """Python strings can hold lone surrogates (JSON's "\\ud800" without its pair), which no
    tokenizer and no UTF-8 response can carry."""
    if not text.isascii():
        utf8_size(text, what)


def is_unicode(text: str) -> bool:
    """check_unicode's test, raising nothing (for a caller that names the text only if it fails)."""
    if text.isascii():  # O(1) for CPython's compact ASCII strings
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_label(text: str, what: str) -> None:
    """A name the engine lists, logs and answers with (an adapter's, a session's): valid
    Unicode without control characters (newlines, NUL, terminal escapes)."""
    check_unicode(text, what)
    at = next((i for i, c in enumerate(text) if unicodedata.category(c) == "Cc"), None)
    if at is not None:
        raise InvalidRequest(
            f"{what} must not contain control characters, got U+{ord(text[at]):04X} at "
            f"position {at} of {text!r:.200}"
        )


def utf8_size(text: str, what: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"{what} is not valid Unicode: lone surrogate U+{ord(text[e.start]):04X} at position "
            f"{e.start} (a high surrogate \\ud800-\\udbff must be followed by a low one "
            "\\udc00-\\udfff)"
        ) from None
