"""Reasoning (`<think>…</think>`) split from the answer, streamed or whole.

Qwen3 opens its reasoning with `<think>` unless the chat template already wrote it into the
prompt (thinking-only checkpoints do); DeepSeek-R1 may or may not write `<think>`, and is always
reasoning until `</think>`. Reasoning text is returned without the whitespace the model puts just
inside the tags, and the answer without the whitespace just after `</think>`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.parsers.text_scan import partial_marker_len

_START, _REASONING, _CONTENT_START, _CONTENT, _UNDECIDED = range(5)


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    # Where an output that does not open with `start` begins: in the reasoning (True), in the
    # answer (False), or undecided (None): reasoning if `end` comes, the answer otherwise.
    in_reasoning: bool | None
    # Markers that end the reasoning and begin the answer without `end` (kept in the answer).
    implicit_ends: tuple[str, ...] = ()
    start: str = "<think>"
    end: str = "</think>"


REASONING_FORMATS = {
    "deepseek-r1": ReasoningFormat("deepseek-r1", in_reasoning=True),
    # Qwen3 sometimes opens a tool call while still thinking, without closing the reasoning.
    "qwen3": ReasoningFormat("qwen3", in_reasoning=None, implicit_ends=("<tool_call>",)),
    "qwen3-thinking": ReasoningFormat(
        "qwen3-thinking", in_reasoning=True, implicit_ends=("<tool_call>",)
    ),
}


class ReasoningParser:
    """Splits one output stream into (reasoning, answer): `feed` each delta in order, then
    `finish` once; each returns the (reasoning_delta, content_delta) it settles. A tag split
    across deltas is held back until it is whole.

    `in_reasoning` overrides the format's default for this request: pass what the prompt says
    (see `opens_in_prompt`), since with an undecided start the answer is held back until the
    output shows whether it was reasoning."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool | None = None) -> None:
        self.format = fmt
        self.in_reasoning = fmt.in_reasoning if in_reasoning is None else in_reasoning
        self._ends = (fmt.end, *fmt.implicit_ends)
        self._buf = ""
        self._state = _START
        self._reasoned = False  # some reasoning text was emitted
        self._searched = 0  # while undecided: buffer before this holds no end marker

    def opens_in_prompt(self, prompt_tail: str) -> bool | None:
        """Whether a prompt ending in `prompt_tail` leaves the model inside its reasoning (the
        template opened `<think>`), outside it (the template wrote an empty, closed block, as
        Qwen3 does with enable_thinking=False), or None when the prompt does not say."""
        tail = prompt_tail.rstrip()
        if tail.endswith(self.format.start):
            return True
        if tail.endswith(self.format.end):
            return False
        return None

    def parse(self, text: str) -> tuple[str, str]:
        """The whole output at once; does not touch this instance's stream."""
        fresh = ReasoningParser(self.format, self.in_reasoning)
        r1, c1 = fresh.feed(text)
        r2, c2 = fresh.finish()
        return r1 + r2, c1 + c2

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """Settles what was held back; an unclosed reasoning stays reasoning (cut short)."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while self._buf:
            step = (
                self._open,
                self._reason,
                self._skip_space,
                self._answer,
                self._undecided,
            )[self._state]
            if not step(final, reasoning, content):
                break
        return "".join(reasoning), "".join(content)

    # Each step settles what it can and returns whether the next state should run now.
    def _open(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        rest = self._buf.lstrip()
        start = self.format.start
        if rest.startswith(start):
            self._buf = rest[len(start) :]
            self._state = _REASONING
            return True
        if not final and start.startswith(rest):
            return False  # the tag may still be coming
        if self.in_reasoning:
            self._buf, self._state = rest, _REASONING
        else:
            self._state = _CONTENT if self.in_reasoning is False else _UNDECIDED
        return True

    def _reason(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        if not self._reasoned:  # whitespace just inside `<think>` is not reasoning
            self._buf = self._buf.lstrip()
        at, marker = self._first_end()
        if at < 0:
            n = len(self._buf)
            if not final:
                n -= partial_marker_len(self._buf, self._ends)
            text = self._buf[:n].rstrip()  # held back: whitespace just before `</think>`
            self._emit_reasoning(reasoning, text)
            self._buf = "" if final else self._buf[len(text) :]
            return False
        self._emit_reasoning(reasoning, self._buf[:at].rstrip())
        if marker == self.format.end:
            self._buf, self._state = self._buf[at + len(marker) :], _CONTENT_START
        else:
            self._buf, self._state = self._buf[at:], _CONTENT
        return True

    def _emit_reasoning(self, reasoning: list[str], text: str) -> None:
        if text:
            reasoning.append(text)
            self._reasoned = True

    def _skip_space(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        self._buf = self._buf.lstrip()
        if self._buf:
            self._state = _CONTENT
        return bool(self._buf)

    def _answer(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        content.append(self._buf)
        self._buf = ""
        return False

    def _undecided(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        # The whole output is held here: search only where a marker could newly end.
        at, marker = self._first_end(self._searched)
        self._searched = max(0, len(self._buf) - max(map(len, self._ends)) + 1)
        if at >= 0 and marker == self.format.end:
            self._emit_reasoning(reasoning, self._buf[:at].strip())
            self._buf, self._state = self._buf[at + len(marker) :], _CONTENT_START
            return True
        if at >= 0 or final:  # an answer after all: it was never inside the reasoning
            self._state = _CONTENT
            return True
        return False

    def _first_end(self, since: int = 0) -> tuple[int, str]:
        best, found = -1, ""
        for marker in self._ends:
            at = self._buf.find(marker, since)
            if at >= 0 and (best < 0 or at < best):
                best, found = at, marker
        return best, found
