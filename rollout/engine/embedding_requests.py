"""Arguments of encode / classify / score -> the engine's requests, and their results back.

encode and classify are prefill-only requests answered with the last token's pooled output
(a causal LM's final-norm hidden state, or a classifier's score head). score runs query + item
through a causal LM for one greedy step and reads the label tokens' logprobs at that next
position, as SGLang's Engine.score does.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

from rollout.config import MAX_SAMPLES_PER_CALL
from rollout.engine.chat_template import chat_ids
from rollout.engine.messages import TokenizedRequest
from rollout.engine.request_limits import RequestLimits
from rollout.engine.request_validation import build_inputs, encode_prompt, validate_prompt_length
from rollout.errors import InvalidRequest
from rollout.generate_request import GenerateRequest

Finish = Callable[[list[dict]], Any]


def is_classifier_checkpoint(model_path: str) -> bool:
    with open(os.path.join(model_path, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in archs)


def check_embedding_mode(model_path: str, is_embedding: bool) -> None:
    """A classifier has no LM head: it can only be served for encode/classify."""
    if is_classifier_checkpoint(model_path) and not is_embedding:
        raise InvalidRequest(
            f"{model_path} is a sequence-classification checkpoint (a score head, no LM head): "
            "start the engine with is_embedding=True to serve it through encode/classify"
        )


def _chat_ids(tokenizer: Any, limits: RequestLimits, messages: Any) -> tuple[list[list[int]], bool]:
    """One conversation (a list of {"role", "content"}) or a list of them -> token ids each."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(
            "messages must be a non-empty list of {role, content} dicts, or a list of such lists"
        )
    batched = isinstance(messages[0], list)
    convs = messages if batched else [messages]
    ids = []
    for conv in convs:
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in conv):
            raise InvalidRequest("each message must be a dict with role and content")
        ids.append(chat_ids(tokenizer, limits, conv, add_generation_prompt=False))
    return ids, batched


def embed_inputs(
    tokenizer: Any, limits: RequestLimits, prompt: Any, input_ids: Any, messages: Any,
    normalize: bool, rid: Any,
) -> tuple[list[TokenizedRequest], Finish]:  # fmt: skip
    """Requests for encode/classify: exactly one of prompt (str or list), input_ids (a list of
    ids or of lists) or messages. The result is one dict per prompt; a single prompt, one dict."""
    if messages is not None:
        if prompt is not None or input_ids is not None:
            raise InvalidRequest("give exactly one of prompt, input_ids or messages")
        input_ids, batched = _chat_ids(tokenizer, limits, messages)
        if not batched:
            input_ids = input_ids[0]
    # Prefill only: no new tokens (the scheduler generates none for an embed request).
    request = GenerateRequest(prompt, {"max_new_tokens": 0}, input_ids, rid=rid)
    inputs, batched = build_inputs(tokenizer, limits, request)
    for inp in inputs:
        inp.embed, inp.normalize = True, bool(normalize)
    return inputs, (lambda outs: outs if batched else outs[0])


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def score_inputs(
    tokenizer: Any, limits: RequestLimits, query: Any, items: Any, label_token_ids: Any,
    apply_softmax: bool, item_first: bool,
) -> tuple[list[TokenizedRequest], Finish]:  # fmt: skip
    """Requests for score: query and items both text (str, and str or list of str) or both
    token ids (a list of ids, and one list or a list of lists). The result is one list per
    item: the probability of each label token at the position after query + item (item +
    query with item_first); with apply_softmax, renormalised over the label tokens."""
    if not _is_ids(label_token_ids) or not label_token_ids:
        raise InvalidRequest("label_token_ids must be a non-empty list of token ids")
    if isinstance(query, str):
        item_list = [items] if isinstance(items, str) else items
        if (
            not isinstance(item_list, list)
            or not item_list
            or not all(isinstance(i, str) for i in item_list)
        ):
            raise InvalidRequest(
                "with a text query, items must be a str or a non-empty list of str"
            )
        _check_count(item_list)
        limits.check_text(query, "the query")
        ids = []
        for i, item in enumerate(item_list):
            limits.check_text(item, f"item {i}")
            text = item + query if item_first else query + item
            ids.append(encode_prompt(tokenizer, limits, text, f"query + item {i}"))
    elif _is_ids(query) and query:
        item_list = [items] if _is_ids(items) else items
        if (
            not isinstance(item_list, list)
            or not item_list
            or not all(_is_ids(i) for i in item_list)
        ):
            raise InvalidRequest(
                "with a token-id query, items must be a list of ids or a list of such lists"
            )
        _check_count(item_list)
        ids = []
        for item in item_list:
            # Before joining them: items x a long query would be a lot of memory to reject.
            validate_prompt_length(len(query) + len(item), limits.context_length)
            ids.append(list(item) + query if item_first else query + list(item))
    else:
        raise InvalidRequest("query must be a non-empty str or a non-empty list of token ids")
    params = {"max_new_tokens": 1, "temperature": 0.0}
    request = GenerateRequest(
        sampling_params=params,
        input_ids=ids,
        return_logprob=True,
        token_ids_logprob=list(label_token_ids),
    )
    inputs, _ = build_inputs(tokenizer, limits, request)

    def finish(outs: list[dict]) -> list[list[float]]:
        return [_label_probs(out, label_token_ids, apply_softmax) for out in outs]

    return inputs, finish


def _check_count(items: list) -> None:
    if len(items) > MAX_SAMPLES_PER_CALL:
        raise InvalidRequest(
            f"score takes at most {MAX_SAMPLES_PER_CALL} items per call, got {len(items)}"
        )


def _label_probs(out: dict, label_token_ids: list[int], apply_softmax: bool) -> list[float]:
    # The first generated position's requested-id logprobs: (logprob, id, text) entries.
    entries = out["meta_info"]["output_token_ids_logprobs"][0]
    by_id = {tid: lp for lp, tid, _ in entries}
    logprobs = [by_id[t] for t in label_token_ids]
    if not apply_softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]
