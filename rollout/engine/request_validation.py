"""Turns `generate(...)` arguments into validated single-sample requests, with clear errors."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rollout.config import MAX_SAMPLES_PER_CALL
from rollout.engine.request_limits import RequestLimits, check_unicode
from rollout.engine.sampling_params import SamplingParams
from rollout.errors import InvalidRequest, InvalidRequestType


@dataclass
class GenerateInput:
    """One sample to generate: prompt ids plus options. `n` is already expanded."""

    input_ids: list[int]
    params: SamplingParams
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_hidden_states: bool = False
    stream: bool = False
    embed: bool = False  # prefill only; the result is the pooled last-token output
    normalize: bool = False
    # The tokens the context leaves after the prompt, where fewer than params.max_new_tokens.
    max_new_tokens_capped: int | None = None


def _as_params(value: Any) -> SamplingParams:
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, dict):
        return SamplingParams.from_dict(value)
    raise InvalidRequestType(f"sampling_params must be a dict or SamplingParams, got {type(value).__name__}")


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


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
    tokenizer: Any,
    limits: RequestLimits,
    prompt: str | list[str] | None,
    input_ids: list[int] | list[list[int]] | None,
    sampling_params: Any,
    rid: str | list[str] | None,
    **options: Any,
) -> tuple[list[GenerateInput], bool]:
    """Returns the expanded samples (prompt-major, n per prompt) and whether the call was batched.
    The bounds of `limits` hold before any prompt is tokenized, but for the response's size,
    which needs the prompts' lengths (and is checked before anything runs)."""
    if (prompt is None) == (input_ids is None):
        raise InvalidRequest("give exactly one of prompt or input_ids")
    if prompt is not None:
        batched = isinstance(prompt, list)
        texts = prompt if batched else [prompt]
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise InvalidRequestType(f"prompt must be a str or a list of str, got {type(t).__name__}")
            if not t:
                raise InvalidRequest("prompt is empty")
            limits.check_text(t, f"prompt {i}" if batched else "the prompt")
        ids_list: list = texts  # tokenized below, once every other argument is checked
    else:
        batched = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        ids_list = input_ids if batched else [input_ids]
        for ids in ids_list:
            if isinstance(ids, list):  # the cheap check first: long lists are slow to scan
                validate_prompt_length(len(ids), limits.context_length)
            if not _is_id_list(ids):
                raise InvalidRequestType("input_ids must be a list of int or a list of lists of int")
    if not ids_list:
        raise InvalidRequest("the list of prompts is empty")

    if isinstance(sampling_params, list):
        if len(sampling_params) != len(ids_list):
            raise InvalidRequest(
                f"sampling_params has {len(sampling_params)} entries for {len(ids_list)} prompts"
            )
        given = sampling_params
    else:
        given = [sampling_params]
    params_list = [_as_params(p) for p in given]
    for params, g in zip(params_list, given):
        _check_params(params, limits, g)
    if len(params_list) != len(ids_list):
        params_list = params_list * len(ids_list)  # one params object for every prompt
    rids = rid if isinstance(rid, list) else [rid] * len(ids_list)
    if len(rids) != len(ids_list):
        raise InvalidRequest(f"rid has {len(rids)} entries for {len(ids_list)} prompts")
    for r in rids:
        if isinstance(r, str):
            check_unicode(r, "rid")

    logprob_start_len = options.get("logprob_start_len")
    if logprob_start_len is not None and logprob_start_len < 0:
        logprob_start_len = None  # SGLang's -1: no prompt logprobs
    top = options.get("top_logprobs_num") or 0
    if not isinstance(top, int) or top < 0:
        raise InvalidRequest(f"top_logprobs_num must be an int >= 0, got {top!r}")
    limits.check_top_logprobs_num(top)
    token_ids_logprob = options.get("token_ids_logprob")
    if token_ids_logprob is not None and not _is_id_list(token_ids_logprob):
        raise InvalidRequestType("token_ids_logprob must be a list of int")

    total = sum(p.n for p in params_list)
    if total > MAX_SAMPLES_PER_CALL:
        raise InvalidRequest(
            f"one call may ask for at most {MAX_SAMPLES_PER_CALL} samples (prompts x n), got {total}"
        )
    if prompt is not None:
        ids_list = [tokenizer.encode(t) for t in ids_list]
    for ids in ids_list:
        if not ids:
            raise InvalidRequest("prompt is empty (no input ids)")
        validate_prompt_length(len(ids), limits.context_length)
        if logprob_start_len is not None and logprob_start_len >= len(ids):
            raise InvalidRequest(
                f"logprob_start_len must be < the prompt length {len(ids)}, got {logprob_start_len}"
            )
    return_logprob = bool(options.get("return_logprob"))
    if return_logprob:
        per_position = top + len(token_ids_logprob or ())
        prompts = [(len(ids), p) for ids, p in zip(ids_list, params_list)]
        limits.check_logprob_entries(prompts, logprob_start_len, per_position)

    out: list[GenerateInput] = []
    for ids, params, r in zip(ids_list, params_list, rids):
        budget = limits.new_token_budget(len(ids), params.max_new_tokens)
        for i in range(params.n):
            sample_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                sample_params = replace(params, n=1, seed=seed)
            out.append(
                GenerateInput(
                    input_ids=list(ids),
                    params=sample_params,
                    rid=None if r is None else (r if params.n == 1 else f"{r}-{i}"),
                    return_logprob=return_logprob,
                    logprob_start_len=logprob_start_len,
                    top_logprobs_num=top,
                    token_ids_logprob=token_ids_logprob,
                    return_hidden_states=bool(options.get("return_hidden_states")),
                    stream=bool(options.get("stream")),
                    max_new_tokens_capped=budget if budget < params.max_new_tokens else None,
                )
            )
    if out[0].stream and len(out) > 1:
        raise InvalidRequest("stream=True takes one prompt with n=1; stream each sample separately")
    return out, batched or len(out) > 1


def _check_params(params: SamplingParams, limits: RequestLimits, given: Any) -> None:
    limits.check_n(params.n)
    # Only a value the caller chose: the default (128) may exceed a short test context.
    if not isinstance(given, dict) or "max_new_tokens" in given:
        limits.check_max_new_tokens(params.max_new_tokens)
    for stop in params.stop or ():
        check_unicode(stop, "a stop string")


def validate_for_model(inp: GenerateInput, vocab_size: int, context_length: int) -> None:
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
