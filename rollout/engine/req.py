"""Scheduler-side state: `Req` (one request) and `ScheduleBatch` (the requests of one step)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.engine.grammar_matcher import RequestGrammar
from rollout.engine.messages import DecodeParams, LogprobColumns, ReqOutput, TokenizedRequest
from rollout.engine.radix_cache import TreeNode
from rollout.forward.forward_batch import ForwardMode

# How many of the prompt's last tokens the detokenizer decodes the output after.
DECODE_CONTEXT_TOKENS = 4


@dataclass
class Req:
    """One sequence. Its KV: slots of tokens [0, prefix_len) belong to the radix cache (locked via
    `locked_node`); slots of [prefix_len, kv_len) belong to the request. Row `row` of the
    req->token table lists them. The last token of `ids` has no KV until the next forward."""

    req: TokenizedRequest
    max_new_tokens: int  # already clamped to the context length
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None
    prefix_len: int = 0
    kv_len: int = 0
    locked_node: TreeNode | None = None
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    # Deltas not yet sent to the detokenizer.
    sent_ids: int = 0
    reported: bool = False
    input_logprobs_done: bool = False
    # News since the last output: logprobs (requests with return_logprob), hidden states,
    # the embedding of an embed request, weight version changes.
    logprobs: LogprobColumns | None = None
    hidden_states: list[list[float]] = field(default_factory=list)
    embedding: list[float] | None = None
    version_changes: list[dict[str, Any]] = field(default_factory=list)
    # The weight version of a request that finished before a version change and is yet to be
    # reported: its outputs carry this one, not the label published after its last token.
    finished_version: str | None = None
    # Does sampling read the tokens generated so far (repetition, frequency or presence
    # penalties)? Then each token must be on the host before the next one is sampled. Read
    # once from the params (they never change): the scheduler asks every step.
    penalizes: bool = field(init=False)
    # Does sampling change its logits in place (penalties, a grammar's mask, logit_bias, or bans
    # while below min_new_tokens)? Then its logprobs are read before sampling (logprob_head.py).
    changes_logits: bool = field(init=False)
    # Where the output stands in the request's grammar (json_schema, regex, ...): set once the
    # grammar is compiled, before the request is first scheduled. Its mask reads the tokens so
    # far, so a request with a grammar `penalizes` too.
    grammar: RequestGrammar | None = None
    # The prefix-cache tree its KV belongs to: None for the base model, its LoRA adapter's
    # (name, load) otherwise (rollout/engine/lora_manager.py).
    cache_namespace: Hashable = None

    def __post_init__(self) -> None:
        if self.req.return_logprob:
            self.logprobs = LogprobColumns()
        p = self.req.params
        self.penalizes = (
            p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)
        )
        if p.grammar is not None:
            self.penalizes = True
        self.changes_logits = self.penalizes or bool(p.logit_bias) or p.min_new_tokens > 0

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def prompt_ids(self) -> list[int]:
        return self.req.input_ids

    @property
    def ids(self) -> list[int]:
        return self.req.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def at_max_new_tokens(self, pending: int = 0) -> bool:
        """Whether its output tokens, with `pending` more still being sampled, reach
        max_new_tokens (which finishes it, whatever the tokens are)."""
        return len(self.output_ids) + pending >= self.max_new_tokens

    def wants_prompt_logprobs(self) -> bool:
        return (
            self.req.return_logprob
            and self.req.logprob_start_len is not None
            and not self.input_logprobs_done
        )

    def max_cacheable_prefix(self) -> int:
        """Longest prefix that may come from the cache: at least one token must be computed
        (its logits sample the next token), and prompt logprobs need their positions' logits."""
        limit = len(self.ids) - 1
        if self.wants_prompt_logprobs():
            limit = min(limit, max(self.req.logprob_start_len, 1) - 1)
        return max(limit, 0)

    def take_output(self, weight_version: str) -> ReqOutput:
        """The request's news since its last output; clears what it reports."""
        new_ids = self.output_ids[self.sent_ids :]
        self.sent_ids = len(self.output_ids)
        decode_params = None
        if not self.reported:
            self.reported = True
            params = self.req.params
            decode_params = DecodeParams(
                tuple(params.stop or ()),
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
                params.no_stop_trim,
                tuple(self.prompt_ids[-DECODE_CONTEXT_TOKENS:]),
            )
        out = ReqOutput(
            rid=self.rid,
            new_ids=new_ids,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens,
            weight_version=weight_version,
            logprobs=self.logprobs,
            hidden_states=self.hidden_states or None,
            embedding=self.embedding,
            weight_version_changes=self.version_changes or None,
            decode_params=decode_params,
        )
        if self.logprobs is not None:
            self.logprobs = LogprobColumns()
        self.hidden_states, self.embedding, self.version_changes = [], None, []
        return out


@dataclass
class ScheduleBatch:
    """One step's work: which requests, and how many new tokens each computes.

    Positions come from `starts`, taken when the batch is planned: a request's host state may
    lag behind the device (its newest token still being sampled) when the batch runs."""

    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]  # new tokens per request (1 in decode)
    out_cache_loc: torch.Tensor  # [sum(extend_lens)] int64 KV slots for the new tokens
    starts: list[int] = field(init=False)  # each request's kv_len when planned: its first position
    sampling: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.starts = [r.kv_len for r in self.reqs]
        # A decode always samples (its input token may still be on the device); an extend
        # samples once it reaches the end of the request's known tokens.
        if self.mode is ForwardMode.DECODE:
            self.sampling = [True] * len(self.reqs)
            return
        self.sampling = [
            start + ext == len(r.ids)
            for r, start, ext in zip(self.reqs, self.starts, self.extend_lens)
        ]

    def split(self) -> list[ScheduleBatch]:
        """One batch per request, each with its own slots of out_cache_loc. (Planned as this
        one was: no request's kv_len has moved since.)"""
        ends = itertools.accumulate(self.extend_lens)
        return [
            ScheduleBatch(self.mode, [req], [n], self.out_cache_loc[end - n : end])
            for req, n, end in zip(self.reqs, self.extend_lens, ends)
        ]

    def samples(self, i: int) -> bool:
        """Does request i sample a token after this step (its whole sequence now has KV)?"""
        return self.sampling[i]
