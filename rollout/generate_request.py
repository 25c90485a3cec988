"""GenerateRequest: the arguments of `generate`, written once.

RolloutEngine.generate / async_generate / validate_generate and RolloutClient.generate /
async_generate take exactly these fields (their signatures come from here, through
`takes_generate_request`), and the body of `POST /generate` is these fields as JSON with `text`
for `prompt` (rollout/server/native.py builds its schema from them). What needs the tokenizer
or the engine's limits is checked where the request is tokenized
(rollout/engine/request_validation.py); the shape of each field is checked here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

from rollout.errors import InvalidRequest, InvalidRequestType

# The JSON name of a field, where it differs from the Python name (SGLang's wire names).
WIRE_NAMES = {"prompt": "text"}


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | list[str] | None = None  # one prompt, or a batch; or give input_ids
    # One dict for every prompt, or one per prompt (see SamplingParams for the keys).
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None  # prompt logprobs from this position (-1 or None: none)
    top_logprobs_num: int | None = None  # the top-k logprobs of each position
    token_ids_logprob: list[int] | None = None  # the logprobs of these ids at each position
    return_hidden_states: bool = False
    stream: bool = False
    rid: str | list[str] | None = None  # request ids (one per prompt), for abort_request
    # The third element of each logprob entry is the token's text (else None).
    return_text_in_logprobs: bool = False
    log_metrics: bool = True  # False: the server's metrics leave this request out
    # The LoRA adapter (by the name it was loaded under) of each prompt; None: the base model.
    lora_path: str | list[str | None] | None = None
    # SGLang's fields for what this engine has no use for yet: null (false) or a clear error.
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    custom_logit_processor: Any = None
    return_routed_experts: bool = False
    pp_rank: int | None = None  # the pipeline stage: the engine has one, 0
    # Continue an open session's turn (rollout/engine/session_params.py): {"id", "rid",
    # "offset", "replace"}; a list holds one per prompt.
    session_params: dict[str, Any] | list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        # Shapes only: a long prompt or id list is scanned where it is tokenized, off the loop.
        for name in ("return_logprob", "return_hidden_states", "stream", "return_text_in_logprobs",
                     "log_metrics", "return_routed_experts"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestType(
                    f"{name} must be a bool, got {type(getattr(self, name)).__name__}"
                )
        for name in ("logprob_start_len", "top_logprobs_num"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise InvalidRequestType(f"{name} must be an int, got {type(value).__name__}")
        if not isinstance(self.rid, (str, list, type(None))):
            raise InvalidRequestType(
                f"rid must be a str or a list of str, got {type(self.rid).__name__}"
            )
        if isinstance(self.rid, list) and not all(isinstance(r, str) for r in self.rid):
            raise InvalidRequestType("rid must be a str or a list of str")
        self._check_unused()

    def _check_unused(self) -> None:
        for name in ("image_data", "video_data", "audio_data"):
            if getattr(self, name) not in (None, [], [None]):
                raise InvalidRequest(f"{name} must be null: this engine serves text-only models")
        lora = self.lora_path if isinstance(self.lora_path, list) else [self.lora_path]
        if not all(p is None or (isinstance(p, str) and p) for p in lora):
            raise InvalidRequestType(
                "lora_path must be a loaded LoRA adapter's name, or a list of one (or null) per "
                "prompt"
            )
        if self.custom_logit_processor is not None:
            raise InvalidRequest(
                "custom_logit_processor must be null: custom logit processors are not supported"
            )
        if self.return_routed_experts:
            raise InvalidRequest(
                "return_routed_experts must be false: the served model has no experts"
            )
        if self.pp_rank not in (None, 0) or isinstance(self.pp_rank, bool):
            raise InvalidRequest(
                f"pp_rank must be null or 0: the engine runs as one pipeline stage, got "
                f"{self.pp_rank!r}"
            )

    @classmethod
    def of(cls, *args: Any, **kwargs: Any) -> GenerateRequest:
        """From generate's arguments, or a GenerateRequest given as the only argument."""
        if len(args) == 1 and not kwargs and isinstance(args[0], GenerateRequest):
            return args[0]
        return cls(*args, **kwargs)

    def to_json(self) -> dict[str, Any]:
        """The body of POST /generate: the fields that are set, under their JSON names."""
        body = {WIRE_NAMES.get(f.name, f.name): getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in body.items() if v is not None}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> GenerateRequest:
        """The inverse of to_json (the body's keys are the JSON names)."""
        python_names = {wire: name for name, wire in WIRE_NAMES.items()}
        return cls(**{python_names.get(k, k): v for k, v in body.items()})


def takes_generate_request(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method(self, request: GenerateRequest)` becomes callable with generate's arguments
    (positional in field order, or by keyword), or with a GenerateRequest; its signature, for
    help() and editors, lists the fields."""
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await method(self, GenerateRequest.of(*args, **kwargs))

    else:

        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return method(self, GenerateRequest.of(*args, **kwargs))

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("self", kind)]
    for f in fields(GenerateRequest):
        default = None if f.default is MISSING else f.default
        params.append(inspect.Parameter(f.name, kind, default=default, annotation=f.type))
    ret = inspect.signature(method).return_annotation
    call.__signature__ = inspect.Signature(params, return_annotation=ret)  # type: ignore[attr-defined]
    return call
