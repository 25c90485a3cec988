"""Parsing a large JSON body without holding the GIL for long: json.loads, in bounded pieces.

json.loads is one C call that makes no Python call for a string, a literal or an array, so a
body of millions of them holds the GIL, and with it the server's event loop, from start to end.
Here objects and arrays are walked in Python, and json's own C scanner is given bounded pieces:

- a run of an array's elements (or an object's members) of at most PIECE_CHARS characters, cut
  at a comma. A cut inside a string or a nested value makes the piece invalid, and those
  elements are then read one at a time (each small one again by the C scanner, as a piece that
  ends where it does); a piece never gives a value json.loads would not;
- a long string, a piece at a time, each cut where no escape sequence or surrogate pair spans it;
- the body's bytes, decoded a piece at a time.

Between two pieces the GIL can pass to the loop. The value, and every error (JSONDecodeError's
message and position), are json.loads': where a piece fails, json's own parse of the same text
raises the error. Two differences: nesting deeper than about a third of the recursion limit
raises RecursionError (json.loads' C scanner goes to the limit itself), and a body of more than
MAX_CONTAINERS arrays and objects raises TooManyContainers, because the garbage collector walks
every live container whenever it makes a full pass, holding the GIL throughout.
"""

from __future__ import annotations

import codecs
import json
import re
import traceback
from json.decoder import JSONDecodeError, scanstring
from json.scanner import c_make_scanner
from typing import Any

from rollout.server.json_release import release

# The most the C scanner or the decoder reads in one call (RESULTS.md has their speeds). A
# container's or a string's first piece is short: most are, and each piece is a copy.
PIECE_CHARS = 2**16
_FIRST_PIECE_CHARS = 2**10
STRING_PIECE_CHARS = 2**20  # strings scan many times faster than arrays of values
_FIRST_STRING_PIECE_CHARS = 2**12
DECODE_PIECE_BYTES = 2**20
# Above what any body of 1 MB can hold (FastAPI's own path parses those), so that limit is
# the same for every body size.
MAX_CONTAINERS = 2**19

_WS = re.compile(r"[ \t\n\r]*")
_WS_CHARS = " \t\n\r"
# json's C scanner reads ASCII digits only (json.scanner's Python one also takes other digits).
_NUMBER = re.compile(r"(-?(?:0|[1-9][0-9]*))(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")
_LOW_SURROGATE = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_CLOSERS = {"[": "]", "{": "}", '"': '"'}
_CONSTANTS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


class TooManyContainers(ValueError):
    def __init__(self) -> None:
        super().__init__(f"the JSON body holds more than {MAX_CONTAINERS} arrays and objects")


def decode_body(body: bytes) -> str:
    """body as text, as json.loads(bytes) decodes it, a piece at a time."""
    encoding = json.detect_encoding(body)
    if len(body) <= DECODE_PIECE_BYTES:
        return body.decode(encoding, "surrogatepass")
    decoder = codecs.getincrementaldecoder(encoding)("surrogatepass")
    view = memoryview(body)
    parts = [
        decoder.decode(view[i : i + DECODE_PIECE_BYTES])
        for i in range(0, len(body), DECODE_PIECE_BYTES)
    ]
    parts.append(decoder.decode(b"", final=True))
    return "".join(parts)


def parse(text: str) -> Any:
    """json.loads(text): the same value, or the same error (see the module's doc)."""
    if text.startswith("\ufeff"):
        raise JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    parser = _Parser(text)
    try:
        value, end = parser.value(_WS.match(text, 0).end())
    except StopIteration as err:
        raise JSONDecodeError("Expecting value", text, err.value) from None
    except BaseException as err:
        # What was read before the error: held by the parser's frames, which the error keeps
        # until it is dropped (on the loop), and then freed in one piece. Released here.
        traceback.clear_frames(err.__traceback__)
        release(parser.unfinished)
        raise
    end = _WS.match(text, end).end()
    if end != len(text):
        unused = [value]
        del value
        release(unused)
        raise JSONDecodeError("Extra data", text, end)
    return value


class _Parser:
    """json.scanner's Python scanner over one text, with pieces given to the C scanner. The
    separators and errors follow json.decoder's JSONArray and JSONObject exactly."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.containers = 0
        self.c_scan = c_make_scanner(json.JSONDecoder())
        self.unfinished: list = []  # the arrays and objects being read, outermost first

    def value(self, idx: int) -> tuple[Any, int]:
        s = self.s
        try:
            nextchar = s[idx]
        except IndexError:
            raise StopIteration(idx) from None
        if nextchar == '"':
            return self.string(idx + 1)
        if nextchar == "{":
            return self.container(self.object, {}, idx + 1)
        if nextchar == "[":
            return self.container(self.array, [], idx + 1)
        for literal, value in (("null", None), ("true", True), ("false", False)):
            if s.startswith(literal, idx):
                return value, idx + len(literal)
        m = _NUMBER.match(s, idx)
        if m is not None:
            integer, frac, exp = m.groups()
            if frac or exp:
                return float(integer + (frac or "") + (exp or "")), m.end()
            return int(integer), m.end()
        for name, constant in _CONSTANTS.items():
            if s.startswith(name, idx):
                return constant, idx + len(name)
        raise StopIteration(idx)

    def container(self, read: Any, value: Any, start: int) -> tuple[Any, int]:
        self.count(1)
        self.unfinished.append(value)
        end = read(value, start)
        self.unfinished.pop()
        return value, end

    def count(self, n: int) -> None:
        self.containers += n
        if self.containers > MAX_CONTAINERS:
            raise TooManyContainers()

    def piece(
        self, start: int, opening: str, closing: str, window: int
    ) -> tuple[Any, int, bool] | int:
        """The C scanner over the container's text from start (at a value or key) to a comma
        within window characters: (the value of that run, the end, whether the container closed
        in it), or, where that text is no complete run, the cut after which to try again."""
        s = self.s
        if s.startswith(closing, start):  # after a comma: json's error, from the caller
            return start
        cut = _cut(s, start, start + window, opening)
        stop = cut if cut > start else min(len(s), start + window)
        text = opening + s[start:stop] + closing
        try:
            value, end = self.c_scan(text, 0)
        except (ValueError, StopIteration, RecursionError):
            return stop
        closed = end < len(text)
        if not closed and stop != cut:  # the closing was ours, and the container goes on
            return stop
        self.count(_containers_in(text, end - 1))
        return value, (start + end - 1 if closed else stop + 1), closed

    def array(self, values: list, start: int) -> int:
        """Reads an array's elements, from after its opening bracket, into values; the end."""
        s = self.s
        end = _WS.match(s, start).end()
        if s[end : end + 1] == "]":
            return end + 1
        try_from, window = end, _FIRST_PIECE_CHARS
        while True:
            if end >= try_from:
                got = self.piece(end, "[", "]", window)
                window = PIECE_CHARS
                if isinstance(got, int):
                    try_from = got + 1
                else:
                    items, end, closed = got
                    values += items
                    if closed:
                        return end
                    end = _WS.match(s, end).end()
                    continue
            try:
                value, end = self.value(end)
            except StopIteration as err:
                raise JSONDecodeError("Expecting value", s, err.value) from None
            values.append(value)
            nextchar = s[end : end + 1]
            if nextchar in _WS_CHARS:
                end = _WS.match(s, end + 1).end()
                nextchar = s[end : end + 1]
            end += 1
            if nextchar == "]":
                return end
            if nextchar != ",":
                raise JSONDecodeError("Expecting ',' delimiter", s, end - 1)
            end = _WS.match(s, end).end()

    def object(self, result: dict, start: int) -> int:
        """Reads an object's members, from after its opening brace, into result; the end."""
        s = self.s
        end = start
        nextchar = s[end : end + 1]
        if nextchar != '"':
            if nextchar in _WS_CHARS:
                end = _WS.match(s, end).end()
                nextchar = s[end : end + 1]
            if nextchar == "}":
                return end + 1
            if nextchar != '"':
                raise JSONDecodeError("Expecting property name enclosed in double quotes", s, end)
        try_from, window = end, _FIRST_PIECE_CHARS
        while True:  # end: at a key's opening quote
            if end >= try_from:
                got = self.piece(end, "{", "}", window)
                window = PIECE_CHARS
                if isinstance(got, int):
                    try_from = got + 1
                else:
                    members, end, closed = got
                    result.update(members)  # as dict(pairs) does: first place, last value
                    if closed:
                        return end
                    end = _object_key(s, end)
                    continue
            end = self.member(result, end + 1)
            nextchar = s[end : end + 1]
            if nextchar in _WS_CHARS:
                end = _WS.match(s, end + 1).end()
                nextchar = s[end : end + 1]
            end += 1
            if nextchar == "}":
                return end
            if nextchar != ",":
                raise JSONDecodeError("Expecting ',' delimiter", s, end - 1)
            end = _object_key(s, end)

    def member(self, result: dict, end: int) -> int:
        """Reads `key: value` from after the key's opening quote into result; the end."""
        s = self.s
        key, end = self.string(end)
        if s[end : end + 1] != ":":
            end = _WS.match(s, end).end()
            if s[end : end + 1] != ":":
                raise JSONDecodeError("Expecting ':' delimiter", s, end)
        end = _WS.match(s, end + 1).end()
        try:
            result[key], end = self.value(end)
        except StopIteration as err:
            raise JSONDecodeError("Expecting value", s, err.value) from None
        return end

    def string(self, start: int) -> tuple[str, int]:
        """The string whose text starts at start (after its opening quote), and its end."""
        s = self.s
        close = s.find('"', start, start + STRING_PIECE_CHARS)
        if close != -1 and s[close - 1] != "\\":  # it ends there: a short string
            return scanstring(s, start)
        parts = []
        a, size = start, _FIRST_STRING_PIECE_CHARS  # most strings here are short: copy little
        while len(s) - a > size:
            cut = _string_cut(s, a, a + size)
            size = min(2 * size, STRING_PIECE_CHARS)
            text = s[a:cut] + '"'
            try:
                part, end = scanstring(text, 0)
            except JSONDecodeError as e:  # the first error in the string, as json finds it
                raise JSONDecodeError(e.msg, s, a + e.pos) from None
            parts.append(part)
            if end < len(text):  # closed before the cut
                return "".join(parts), a + end
            a = cut
        try:
            part, end = scanstring(s, a)
        except JSONDecodeError as e:
            if e.pos == a - 1:  # unterminated: the string starts before a
                raise JSONDecodeError(e.msg, s, start - 1) from None
            raise
        parts.append(part)
        return "".join(parts), end


def _object_key(s: str, end: int) -> int:
    """From after a member's comma, the position of the next key's opening quote."""
    end = _WS.match(s, end).end()
    if s[end : end + 1] != '"':
        raise JSONDecodeError("Expecting property name enclosed in double quotes", s, end)
    return end


def _cut(s: str, start: int, stop: int, opening: str) -> int:
    """The last comma in s[start:stop] likely to end an array's element (one after the
    character that the element at start ends with, where that is a bracket or a quote) or an
    object's member."""
    closer = _CLOSERS.get(s[start : start + 1]) if opening == "[" else None
    if closer is not None:
        k = s.rfind(closer + ",", start, stop)
        return k + 1 if k != -1 else -1
    return s.rfind(",", start, stop)


def _containers_in(text: str, end: int) -> int:
    """The arrays and objects of the valid JSON text[1:end], not counting brackets in strings."""
    n = text.count("[", 1, end) + text.count("{", 1, end)
    if n and text.find('"', 1, end) != -1:
        bare = _STRING.sub("", text[1:end])
        n = bare.count("[") + bare.count("{")
    return n


def _string_cut(s: str, a: int, b: int) -> int:
    """A place in (a, b] to cut a string's text that starts, at a, outside any escape: no escape
    sequence or surrogate pair (two \\u escapes, joined by the scanner) spans it."""
    k = s.find("\\", b - 12, b)
    if k == -1:
        return b
    if not _starts_escape(s, a, k):  # the second of an escaped backslash
        return k + 1
    if _LOW_SURROGATE.match(s, k) and _HIGH_SURROGATE.match(s, k - 6):
        if _starts_escape(s, a, k - 6):
            return k - 6
    return k


def _starts_escape(s: str, a: int, k: int) -> bool:
    """Whether the backslash at k starts an escape: an even number of backslashes before it."""
    before = s[a:k]
    return (len(before) - len(before.rstrip("\\"))) % 2 == 0
