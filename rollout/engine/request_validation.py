"""Turns `generate(...)` arguments into validated single-sample requests, with clear errors."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rollout.config import MAX_SAMPLES_PER_CALL
from rollout.engine.messages import TokenizedRequest
from rollout.engine.request_limits import RequestLimits, check_unicode
from rollout.engine.sampling_params import SamplingParams
from rollout.errors import InvalidRequest, InvalidRequestType
from rollout.generate_request import GenerateRequest


def _as_params(value: Any) -> SamplingParams:
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, dict):
        return SamplingParams.from_dict(value)
    raise InvalidRequestType(
        f"sampling_params must be a dict or SamplingParams, got {type(value).__name__}"
    )


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def encode_prompt(
    tokenizer: Any, limits: RequestLimits, text: str, what: str = "the prompt"
) -> list[int]:
    """A prompt text's ids, after the checks that need no tokenizing (size, UTF-8)."""
    limits.check_text(text, what)
    # NOTE: transformers' encode runs the Rust tokenizer's encode_batch, which releases the GIL
    # (a worker thread then leaves the event loop free); the Rust single-text `encode` holds
    # it throughout (RESULTS.md: the loop freezes for the whole encode).
    return tokenizer.encode(text)


def build_inputs(
    tokenizer: Any, limits: RequestLimits, request: GenerateRequest
) -> tuple[list[TokenizedRequest], bool]:
    """Returns the expanded samples (prompt-major, n per prompt) and whether the call was batched.
    The bounds of `limits` hold before any prompt is tokenized, but for the response's size,
    which needs the prompts' lengths (and is checked before anything runs)."""
    prompts, batched = _prompts(limits, request)
    params_list = _params(limits, request.sampling_params, len(prompts))
    rids = request.rid if isinstance(request.rid, list) else [request.rid] * len(prompts)
    if len(rids) != len(prompts):
        raise InvalidRequest(f"rid has {len(rids)} entries for {len(prompts)} prompts")
    named = [r for r in rids if r is not None]
    for r in named:
        check_unicode(r, "rid")
    if len(set(named)) < len(named):  # else the second sample is refused once the first runs
        raise InvalidRequest(
            f"rid must name each prompt of a batch once (a list of distinct rids, one per "
            f"prompt, or none), got {request.rid!r:.200} for {len(prompts)} prompts"
        )
    logprob_start_len = request.logprob_start_len
    if logprob_start_len is not None and logprob_start_len < -1:
        raise InvalidRequest(
            f"logprob_start_len must be -1 (no prompt logprobs) or a prompt position >= 0, "
            f"got {logprob_start_len}"
        )
    if logprob_start_len == -1:
        logprob_start_len = None  # SGLang's -1: no prompt logprobs
    top = request.top_logprobs_num or 0
    if top < 0:
        raise InvalidRequest(f"top_logprobs_num must be an int >= 0, got {top!r}")
    limits.check_top_logprobs_num(top)
    token_ids_logprob = request.token_ids_logprob
    if token_ids_logprob is not None and not _is_id_list(token_ids_logprob):
        raise InvalidRequestType("token_ids_logprob must be a list of int")
    total = sum(p.n for p in params_list)
    if total > MAX_SAMPLES_PER_CALL:
        raise InvalidRequest(
            f"one call may ask for at most {MAX_SAMPLES_PER_CALL} samples (prompts x n), got {total}"
        )
    ids_list = [tokenizer.encode(t) for t in prompts] if request.prompt is not None else prompts
    for ids in ids_list:
        if not ids:
            raise InvalidRequest("prompt is empty (no input ids)")
        validate_prompt_length(len(ids), limits.context_length)
        if logprob_start_len is not None and logprob_start_len >= len(ids):
            raise InvalidRequest(
                f"logprob_start_len must be < the prompt length {len(ids)}, got {logprob_start_len}"
            )
    if request.return_logprob:
        per_position = top + len(token_ids_logprob or ())
        sizes = [(len(ids), p) for ids, p in zip(ids_list, params_list)]
        limits.check_logprob_entries(sizes, logprob_start_len, per_position)
    template = TokenizedRequest(
        rid=None,
        input_ids=[],
        params=SamplingParams(),
        return_logprob=request.return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top,
        token_ids_logprob=token_ids_logprob,
        return_hidden_states=request.return_hidden_states,
        stream=request.stream,
        return_text_in_logprobs=request.return_text_in_logprobs,
    )
    loras = _per_prompt(request.lora_path, len(prompts), "lora_path")
    out = [
        sample
        for ids, params, rid, lora in zip(ids_list, params_list, rids, loras)
        for sample in _samples(
            template if lora is None else replace(template, lora_name=lora), limits, ids, params, rid
        )
    ]
    return out, batched or len(out) > 1


def _per_prompt(value: Any, num_prompts: int, name: str) -> list:
    """A field given once for every prompt, or as a list of one per prompt."""
    if not isinstance(value, list):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise InvalidRequest(f"{name} has {len(value)} entries for {num_prompts} prompts")
    return value


def _prompts(limits: RequestLimits, request: GenerateRequest) -> tuple[list, bool]:
    """The prompts as texts (tokenized later, once every other argument is checked) or id
    lists, and whether they came as a batch."""
    prompt, input_ids = request.prompt, request.input_ids
    if (prompt is None) == (input_ids is None):
        raise InvalidRequest("give exactly one of prompt or input_ids")
    for given in (prompt, input_ids):
        # Before any per-prompt check: a list of millions is refused at once.
        if (
            isinstance(given, list)
            and len(given) > MAX_SAMPLES_PER_CALL
            and not _is_id_list(given[:1])
        ):
            raise InvalidRequest(
                f"one call may ask for at most {MAX_SAMPLES_PER_CALL} samples (prompts x n), "
                f"got {len(given)} prompts"
            )
    if prompt is not None:
        batched = isinstance(prompt, list)
        texts = prompt if batched else [prompt]
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise InvalidRequestType(
                    f"prompt must be a str or a list of str (text in /generate's JSON), got "
                    f"{type(t).__name__}"
                )
            if not t:
                raise InvalidRequest("prompt is empty")
            limits.check_text(t, f"prompt {i}" if batched else "the prompt")
        prompts = texts
    else:
        batched = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        for ids in prompts:
            if isinstance(ids, list):  # the cheap check first: long lists are slow to scan
                validate_prompt_length(len(ids), limits.context_length)
            if not _is_id_list(ids):
                raise InvalidRequestType(
                    "input_ids must be a list of int or a list of lists of int"
                )
    if not prompts:
        raise InvalidRequest("the list of prompts is empty")
    return prompts, batched


def _params(limits: RequestLimits, sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
    """One checked SamplingParams per prompt."""
    if isinstance(sampling_params, list):
        if len(sampling_params) != num_prompts:
            raise InvalidRequest(
                f"sampling_params has {len(sampling_params)} entries for {num_prompts} prompts"
            )
        given = sampling_params
    else:
        given = [sampling_params]
    params_list = [_as_params(p) for p in given]
    for params, g in zip(params_list, given):
        _check_params(params, limits, g)
    return params_list if len(params_list) == num_prompts else params_list * num_prompts


def _samples(
    template: TokenizedRequest, limits: RequestLimits, ids: list[int], params: SamplingParams,
    rid: str | None,
) -> list[TokenizedRequest]:  # fmt: skip
    """The n samples of one prompt: seeds seed, seed + 1, ... and rids rid-0, rid-1, ... (each
    sample keeps rid as its group_rid)."""
    budget = limits.new_token_budget(len(ids), params.max_new_tokens)
    capped = budget if budget < params.max_new_tokens else None
    if params.n == 1:
        return [
            replace(
                template, rid=rid, input_ids=list(ids), params=params, max_new_tokens_capped=capped
            )
        ]
    return [
        replace(
            template,
            rid=None if rid is None else f"{rid}-{i}",
            group_rid=rid,
            input_ids=list(ids),
            params=replace(params, n=1, seed=None if params.seed is None else params.seed + i),
            max_new_tokens_capped=capped,
        )
        for i in range(params.n)
    ]


def _check_params(params: SamplingParams, limits: RequestLimits, given: Any) -> None:
    limits.check_n(params.n)
    # Only a value the caller chose: the default (128) may exceed a short test context.
    if not isinstance(given, dict) or "max_new_tokens" in given:
        limits.check_max_new_tokens(params.max_new_tokens)
    for stop in params.stop or ():
        check_unicode(stop, "a stop string")


def validate_for_model(inp: TokenizedRequest, vocab_size: int, context_length: int) -> None:
    """Checks what depends on the model: prompt length and every token id against the vocabulary."""
    validate_input_ids(inp.input_ids, vocab_size, context_length)
    bad = [t for t in inp.token_ids_logprob or () if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token_ids_logprob must hold ids in [0, {vocab_size}), got {bad[:5]}")
    bad = [t for t in inp.params.stop_token_ids or () if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"stop_token_ids must hold ids in [0, {vocab_size}), got {bad[:5]}")


def validate_input_ids(ids: list[int], vocab_size: int, context_length: int) -> None:
    validate_prompt_length(len(ids), context_length)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token ids must be in [0, {vocab_size}), got {bad[:5]}")


def validate_prompt_length(prompt_tokens: int, context_length: int) -> None:
    if prompt_tokens >= context_length:
        raise InvalidRequest(
            f"the prompt has {prompt_tokens} tokens, which leaves no room in the context of "
            f"{context_length} tokens"
        )
