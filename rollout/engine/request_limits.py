"""What one call may ask for, checked before any work: prompt text size and encoding, n,
top_logprobs_num, max_new_tokens against the context, and the logprob entries of the response.

Each check raises ValueError naming the bound (the option that sets it) and the value got.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

from rollout.config import RequestOptions
from rollout.errors import InvalidRequest
from rollout.text_checks import check_unicode, utf8_size


@dataclass(frozen=True)
class RequestLimits:
    """The engine's RequestOptions joined with the context length the scheduler serves."""

    context_length: int
    options: RequestOptions

    @property
    def max_prompt_bytes(self) -> int:
        return self.context_length * self.options.max_bytes_per_token

    def check_text(self, value: Any, what: str = "the prompt") -> None:
        """One prompt's text (a str, or the messages of one chat): encodable as UTF-8 and short
        enough to fit the context. Measured in UTF-8 bytes, without tokenizing: a token is at
        least one byte, so the bound also caps the tokens a tokenizer can make of it."""
        limit = self.max_prompt_bytes
        size = 0
        for text in [value] if isinstance(value, str) else _strings(value):
            size += len(text)  # characters: a lower bound on bytes, known without encoding
            if size > limit:
                self._too_long(what, size, exact=isinstance(value, str) and text.isascii())
            if not text.isascii():  # O(1) for CPython's compact ASCII strings
                size += utf8_size(text, what) - len(text)
        if size > limit:
            self._too_long(what, size, exact=True)

    def _too_long(self, what: str, size: int, exact: bool) -> NoReturn:
        raise InvalidRequest(
            f"{what} has {'' if exact else 'at least '}{size} bytes of UTF-8 text, over the "
            f"limit of {self.max_prompt_bytes} (context_length {self.context_length} x "
            f"max_bytes_per_token {self.options.max_bytes_per_token}): no longer text fits "
            "the context, so it is refused without tokenizing"
        )

    def check_n(self, n: int) -> None:
        if n > self.options.max_n:
            raise InvalidRequest(f"n must be <= {self.options.max_n} (option max_n), got {n}")

    def check_top_logprobs_num(self, top: int) -> None:
        if top > self.options.max_top_logprobs_num:
            raise InvalidRequest(
                f"top_logprobs_num must be <= {self.options.max_top_logprobs_num} "
                f"(option max_top_logprobs_num), got {top}"
            )

    def check_max_new_tokens(self, max_new_tokens: int) -> None:
        if max_new_tokens > self.context_length:
            raise InvalidRequest(
                f"max_new_tokens must be <= the context length {self.context_length}, "
                f"got {max_new_tokens}"
            )

    def new_token_budget(self, prompt_len: int, max_new_tokens: int) -> int:
        """How many tokens a prompt of prompt_len can get: the context caps max_new_tokens
        (as the scheduler does)."""
        return max(0, min(max_new_tokens, self.context_length - prompt_len))

    def check_logprob_entries(
        self, prompts: Iterable[tuple[int, Any]], logprob_start_len: int | None, per_position: int
    ) -> None:
        """prompts: (prompt length, SamplingParams) of each prompt of a call. Bounds the top /
        token_ids logprob entries its response can hold, before any of it runs."""
        total = 0
        for prompt_len, params in prompts:
            prompt_positions = 0 if logprob_start_len is None else prompt_len - logprob_start_len
            budget = self.new_token_budget(prompt_len, params.max_new_tokens)
            total += params.n * (prompt_positions + budget) * per_position
        if total > self.options.max_logprob_entries:
            raise InvalidRequest(
                f"this call could return {total} top-logprob and token_ids_logprob entries "
                "(samples x logprob positions x (top_logprobs_num + len(token_ids_logprob))), "
                f"more than the limit of {self.options.max_logprob_entries} (option "
                "max_logprob_entries): ask for fewer samples, tokens or entries per token"
            )


def check_unicode_in(value: Any, what: str) -> None:
    """check_unicode on every string of a JSON-like value, keys included."""
    for text in _strings(value):
        check_unicode(text, what)


def _strings(value: Any) -> Iterator[str]:
    # Iterative: JSON can nest deeper than Python recurses.
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
