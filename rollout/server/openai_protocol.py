"""Request bodies of the OpenAI-compatible API, with the extra sampling fields SGLang and vLLM
accept (top_k, min_p, repetition_penalty, ignore_eos, ...). Unknown fields are an error, and
types are not converted ("2" is no int, "yes" no bool, 1 no bool), as OpenAI checks them; an
int is a float (temperature 1)."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    SkipValidation,
    field_validator,
    model_validator,
)  # fmt: skip

from rollout.engine.grammar_openai import response_format_grammar
from rollout.errors import InvalidRequest
from rollout.server.json_body import BODY_CONFIG


class StreamOptions(BaseModel):
    model_config = BODY_CONFIG

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = BODY_CONFIG

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    max_tokens: int | None = None
    # Extras, SGLang/vLLM style
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # Constrained output (see rollout.engine.grammar_spec): OpenAI's response_format
    # (json_object, json_schema), or SGLang's extras; at most one of all of them.
    response_format: dict[str, Any] | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    # The client's names of the engine's fields, where an API in front of this one (Responses)
    # asked with its own; see api_names.
    _renamed: dict[str, str] = PrivateAttr(default_factory=dict)

    def rename(self, engine_name: str, api_name: str) -> None:
        """Has the engine's refusals call its field `engine_name` `api_name` (api_names)."""
        self._renamed[engine_name] = api_name

    def as_named(self, message: str) -> str:
        """An engine refusal's `message` with its fields named as this request named them."""
        for engine_name, api_name in self.api_names().items():
            message = re.sub(rf"\b{engine_name}\b", api_name, message)
        return message

    def api_names(self) -> dict[str, str]:
        """The engine's sampling field names (its errors use them) -> this request's names."""
        names = {"max_new_tokens": self.max_tokens_name(), "min_new_tokens": "min_tokens"}
        return {**names, **self._renamed}

    def max_tokens_name(self) -> str:
        return "max_tokens"

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """The engine's sampling params (validated there, with clear errors)."""
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": self.min_tokens,
            "n": self.n,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "seed": self.seed,
            "logit_bias": self.logit_bias,
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        params.update(self.grammar_params())
        return params

    def grammar_params(self) -> dict[str, Any]:
        """The grammar fields of the engine's sampling params (checked there)."""
        given = {
            "json_schema": self.json_schema,
            "regex": self.regex,
            "ebnf": self.ebnf,
            "structural_tag": self.structural_tag,
        }
        given = {k: v for k, v in given.items() if v is not None}
        from_format = response_format_grammar(self.response_format)
        if from_format:  # the engine's refusals of the schema then name the client's field
            self.rename("json_schema", "response_format")
        if from_format and given:
            kind = (self.response_format or {}).get("type")
            raise InvalidRequest(
                f"response_format {kind!r} can't be combined with {', '.join(given)}"
            )
        return {**given, **from_format}


class CompletionRequest(SamplingFields):
    # Checked where it is tokenized, off the event loop (openai_api._prompts; see native.py).
    prompt: SkipValidation[str | list[str] | list[int] | list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # with logprobs: the prompt's tokens and logprobs come first
    # Fill-in-the-middle text after the completion: as in SGLang, accepted and not used (the
    # completion is generated from the prompt alone).
    suffix: str | None = None

    @model_validator(mode="after")
    def _max_tokens_in_range(self) -> CompletionRequest:
        # As vLLM: 0 only with echo, which scores the prompt (its logprobs) without generating.
        least = 0 if self.echo else 1
        if self.max_tokens is not None and self.max_tokens < least:
            raise ValueError(
                f"max_tokens must be >= {least}{'' if self.echo else ' (0 only with echo)'}, "
                f"got {self.max_tokens}"
            )
        return self


class TextPart(BaseModel):
    model_config = BODY_CONFIG

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = BODY_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as they were returned
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _content_where_required(self) -> ChatMessage:
        # OpenAI's rule: only an assistant's message (one that made tool calls) may omit it.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required in a {self.role} message")
        return self

    @field_validator("tool_calls")
    @classmethod
    def _calls_shape(cls, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, call in enumerate(calls or ()):
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(
                    f"tool_calls[{i}].function must be an object with a string name, got "
                    f"{function!r:.100}"
                )
            if not isinstance(function.get("arguments", ""), (str, dict)):
                raise ValueError(
                    f"tool_calls[{i}].function.arguments must be a JSON string, got "
                    f"{function['arguments']!r:.100}"
                )
        return calls

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as chat templates read it: arguments as an object, not a string."""
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError:
            pass  # the template gets the text as it was
    return {**call, "function": function}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None  # {"type": "function", "function": {name, ...}}
    tool_choice: str | dict[str, Any] | None = None  # auto, none, required, or a named function
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _limits_and_logprobs(self) -> ChatCompletionRequest:
        for name in ("max_tokens", "max_completion_tokens"):  # OpenAI's bound for chat
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        # Refused, not dropped unseen, as vLLM does; 0 asks for nothing, so it may go alone.
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs ({self.top_logprobs}) needs logprobs: true")
        return self

    @field_validator("tools")
    @classmethod
    def _tools_shape(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(tools or ()):
            if tool.get("type", "function") != "function":
                raise ValueError(
                    f"tools[{i}].type must be 'function', got {tool.get('type')!r:.100}"
                )
            function = tool.get("function")
            if not isinstance(function, dict):
                raise ValueError(f"tools[{i}].function must be an object, got {function!r:.100}")
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"tools[{i}].function.name must be a non-empty string, got {name!r:.100}"
                )
            parameters = function.get("parameters")
            if parameters is not None and not isinstance(parameters, (dict, bool)):
                raise ValueError(
                    f"tools[{i}].function.parameters must be a JSON schema object, got "
                    f"{parameters!r:.100}"
                )
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_shape(cls, choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(choice, dict):
            function = choice.get("function")
            if (
                choice.get("type") != "function"
                or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
            ):
                raise ValueError(
                    'tool_choice must be "auto", "none", "required" or {"type": "function", '
                    f'"function": {{"name": ...}}}}, got {choice!r:.100}'
                )
        return choice

    def max_tokens_name(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def tool_names(self) -> list[str] | None:
        """The functions the model may call (None: no tools, or tool_choice none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [str((t.get("function") or {}).get("name")) for t in self.tools]
