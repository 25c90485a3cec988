"""The contract of a tool-call parser, and the stream loop every format shares.

A format says where a call block may start (`_find_block`) and reads one block (`_read_block`);
the loop here turns that into one `feed`/`finish` stream. The whole-text `parse` is that same
stream fed at once, so a streamed output always adds up to the non-streamed result.

Rules every format follows:
- A block that is not a valid call (bad JSON, wrong shape, a function the request did not offer,
  cut off) is returned verbatim as normal text. Parsing never raises on model output.
- Whitespace touching a call (the newlines a model writes around and between calls) is dropped;
  an output with no call comes back exactly as written.
- A call is emitted once its block is complete and valid, never before: a stream cannot take
  back a call that later turns out malformed, so no half-call is ever sent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from rollout.parsers.text_scan import JsonSpan, partial_marker_len
from rollout.parsers.types import TextAndCalls, ToolCall


@dataclass(frozen=True)
class Block:
    end: int  # index just past the block in the buffer
    calls: list[ToolCall] | None  # None: not a call; the block's text is normal text


class ToolCallParser(ABC):
    """Splits a model's output into normal text and tool calls, streamed or whole.

    One instance parses one output stream: `feed` each text delta in order, then `finish` once.
    `tools` names the functions the request offered; a call to any other is left as text
    (None accepts any name)."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]  # strings that open a call block; held back while partial
    # The format's markers are special tokens: the route must decode with
    # skip_special_tokens=False or the markers never reach the parser.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: Iterable[str] | None = None) -> None:
        self.tools = frozenset(tools) if tools is not None else None
        self._buf = ""  # output not yet settled into text or calls
        self._consumed = 0  # characters of output settled so far
        self._after_call = False
        self._span = JsonSpan()  # the pending block's JSON, scanned incrementally

    def parse(self, text: str) -> TextAndCalls:
        """The whole output at once; does not touch this instance's stream."""
        fresh = type(self)(self.tools)
        out = fresh.feed(text)
        rest = fresh.finish()
        return TextAndCalls(out.text + rest.text, out.calls + rest.calls)

    def feed(self, delta: str) -> TextAndCalls:
        """Normal text and calls that `delta` settles; text that may still turn out to be part
        of a call (a partial marker, an open block, whitespace before one) is held back."""
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> TextAndCalls:
        """Settles what was held back: the output ended, so open blocks are normal text."""
        return self._drain(final=True)

    @abstractmethod
    def _find_block(self, buf: str) -> int:
        """Index in `buf` where the first call block starts (whole marker seen), or -1."""

    @abstractmethod
    def _read_block(self, buf: str, start: int, final: bool) -> Block | None:
        """The block starting at `start`, or None while more text is needed to decide (never
        None when `final`). Block.end > start, and depends only on the text, not on how it
        was chunked."""

    def _drain(self, final: bool) -> TextAndCalls:
        out = TextAndCalls()
        while True:
            if self._after_call:
                stripped = self._buf.lstrip()
                self._take(len(self._buf) - len(stripped))
                if not stripped:
                    return out
            buf = self._buf
            start = self._find_block(buf)
            if start < 0:
                end = len(buf)
                if not final:
                    end -= partial_marker_len(buf, self.markers)
                    end = len(buf[:end].rstrip())
                self._emit_text(out, end)
                return out
            block = self._read_block(buf, start, final)
            if block is None:
                assert not final, f"{self.name}: a block must be decided at the end"
                self._emit_text(out, len(buf[:start].rstrip()))
                return out
            self._span = JsonSpan()
            if block.calls is None:
                self._emit_text(out, block.end)
                continue
            out.text += buf[:start].rstrip()
            out.calls.extend(block.calls)
            self._take(block.end)
            self._after_call = True

    def _emit_text(self, out: TextAndCalls, n: int) -> None:
        if n:
            out.text += self._buf[:n]
            self._take(n)
            self._after_call = False

    def _take(self, n: int) -> None:
        self._buf = self._buf[n:]
        self._consumed += n


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
