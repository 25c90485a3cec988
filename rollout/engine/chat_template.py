"""Chat messages -> prompt ids through the tokenizer's chat template, the caller's part bounded.

Callers may pass template variables (`chat_template_kwargs`: enable_thinking, tools, ...). A
template of the caller's own (`chat_template`) runs loops of its choosing, so it needs the
option allow_user_chat_template and renders under a deadline; the keys of the tokenizer call
itself (tokenize, return_tensors, ...) are set here and never taken from the caller.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from rollout.engine.request_limits import RequestLimits, check_unicode_in
from rollout.errors import InvalidRequest, InvalidRequestType

USER_TEMPLATE_KEY = "chat_template"
# apply_chat_template's own parameters that the template sees as variables.
_TEMPLATE_PARAMETERS = frozenset({"tools", "documents"})
_TRACE_CHECK_EVERY = 256  # trace events between clock reads: the deadline costs little


class TemplateTimeout(ValueError):
    """A caller's chat template rendered for longer than chat_template_timeout_s."""


def chat_ids(
    tokenizer: Any,
    limits: RequestLimits,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt ids of one conversation (with `tools`: the functions the template lists for
    the model). Raises ValueError for messages, kwargs or a rendered text beyond the limits,
    and for a template that fails on them."""
    kwargs = dict(template_kwargs or {})
    check_template_kwargs(tokenizer, limits, kwargs)
    limits.check_text(messages, "the messages")
    if tools:
        limits.check_text(tools, "the tools")
        kwargs["tools"] = tools
    user_template = USER_TEMPLATE_KEY in kwargs
    timeout = limits.options.chat_template_timeout_s
    try:
        with _deadline(timeout) if user_template else nullcontext():
            text = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **kwargs,
            )
    except TemplateTimeout:
        raise
    except Exception as e:  # noqa: BLE001 - a template error is the caller's input problem
        raise InvalidRequest(f"the chat template failed on these messages: {e}") from e
    if not isinstance(text, str):
        raise InvalidRequest(f"the chat template rendered a {type(text).__name__}, not text")
    limits.check_text(text, "the rendered chat")
    return tokenizer.encode(text, add_special_tokens=False)  # the template wrote them


def check_template_kwargs(tokenizer: Any, limits: RequestLimits, kwargs: dict[str, Any]) -> None:
    """Only template variables; a template of the caller's own only where the options allow it."""
    if not all(isinstance(k, str) for k in kwargs):
        raise InvalidRequestType("chat_template_kwargs keys must be strings")
    check_unicode_in(kwargs, "chat_template_kwargs")
    reserved = sorted(set(kwargs) & _call_keys(tokenizer))
    if reserved:
        hint = ""
        if "continue_final_message" in reserved:
            hint = " (continue_final_message is a request field of its own)"
        raise InvalidRequest(
            f"chat_template_kwargs may hold template variables only, not {', '.join(reserved)}: "
            f"the server decides how the template is called{hint}"
        )
    if USER_TEMPLATE_KEY in kwargs and not limits.options.allow_user_chat_template:
        raise InvalidRequest(
            "chat_template_kwargs.chat_template (a template of the caller's own) is not accepted "
            "by this server; the model's own template renders the messages (the server option "
            "allow_user_chat_template accepts callers' templates)"
        )
    if USER_TEMPLATE_KEY in kwargs and not isinstance(kwargs[USER_TEMPLATE_KEY], str):
        raise InvalidRequestType("chat_template_kwargs.chat_template must be a string (a Jinja template)")


def _call_keys(tokenizer: Any) -> frozenset[str]:
    """The parameters of this transformers version's apply_chat_template that are not template
    variables, and the names the template's own inputs take."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    named = {name for name, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    variables = _TEMPLATE_PARAMETERS | {USER_TEMPLATE_KEY}
    return frozenset((named - variables) | {"messages", "conversation"})


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raises TemplateTimeout inside the Python code this thread runs once `seconds` have
    passed. Jinja compiles templates to Python, so a tracer sees every loop of a template; a
    single long C-level operation (one huge string) is not cut short."""
    end = time.monotonic() + seconds
    events = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal events
        events += 1
        if events % _TRACE_CHECK_EVERY == 0 and time.monotonic() > end:
            raise TemplateTimeout(
                f"the chat template took longer than {seconds} s to render (option "
                "chat_template_timeout_s)"
            )
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)  # this thread only
    try:
        yield
    finally:
        sys.settrace(previous)
