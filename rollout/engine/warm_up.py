"""Warm-up: what the first requests would compile, compiled before the engine says it is ready.

On a GPU each Triton kernel variant is compiled (or loaded from the disk cache) by the first
process to launch it, and FlashInfer builds or loads a module on its first use. Capturing the
decode graphs covers decode at the graphs' sizes; a prefill, a prefill over a cached prefix, an
eager decode past the largest graph, each sampling variant (filters, penalties, logit bias)
and the logprob head would otherwise compile inside the first requests that use them: seconds
on a fresh machine, inside whatever is being served or timed. `warm_up` runs a few short
requests that use each of them through a scheduler of its own over the engine's model runner,
then drops it: the engine's scheduler starts with nothing cached and nothing counted. Outputs
do not depend on it (each request samples from its own seed).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from itertools import combinations

from rollout.config import EngineOptions
from rollout.engine.messages import TokenizedRequest
from rollout.engine.model_runner import ModelRunner
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.stop_checker import StopChecker
from rollout.forward.all_reduce_norm import FUSED_MAX_TOKENS

logger = logging.getLogger(__name__)

# Rows of a sampling batch: enough for the sampling kernels, which run from a few dozen rows
# (forward/kernel_plan.py's SAMPLING_KERNEL_MIN_ROWS).
BATCH_ROWS = 32
PROMPT_TOKENS = 8
PREFIX_TOKENS = 64  # the cached prefix that a later phase extends
FILTERS = {"top_k": 20, "top_p": 0.9, "min_p": 0.05}


def warm_up(
    options: EngineOptions, runner: ModelRunner, stop_checker: StopChecker, rows: int = BATCH_ROWS
) -> int:
    """Runs the warm-up requests to the end on a scheduler of their own; returns how many ran.
    The KV they used is free again and nothing of theirs stays cached."""
    from rollout.engine.scheduler import Scheduler

    scheduler = Scheduler(options, runner, stop_checker)
    ran = 0
    for phase in _phases(options, runner, rows):
        for request in phase:
            scheduler.add_request(request)
        ran += len(phase)
        while scheduler.has_work():
            for req in scheduler.step():
                if req.finished and req.finish_reason.get("type") not in ("length", "stop"):
                    logger.warning("warm-up request %s ended: %s", req.rid, req.finish_reason)
        scheduler.take_reports()
    scheduler.flush_cache()
    if not scheduler.kv.is_whole():
        raise RuntimeError("the warm-up requests left KV slots in use")
    return ran


def _phases(
    options: EngineOptions, runner: ModelRunner, rows: int
) -> Iterator[list[TokenizedRequest]]:
    """The requests, in phases run one after the other: a phase reuses what the last cached."""
    vocab, room = runner.vocab_size, runner.context_length - 2  # 2 new tokens each
    if room < PROMPT_TOKENS + 16:  # a context this short runs no warm-up
        return
    ids = [(7 + 13 * i) % vocab for i in range(min(PREFIX_TOKENS + 16, room))]
    prefix = len(ids) - 16
    seeds = iter(range(1 << 20))

    def request(tokens: list[int], logprobs: bool = False, **fields) -> TokenizedRequest:
        seed = next(seeds)
        params = SamplingParams(max_new_tokens=2, ignore_eos=True, **{"temperature": 0.0, **fields})
        return TokenizedRequest(
            f"warm-up-{seed}", tokens, params, seed=seed,
            return_logprob=logprobs, top_logprobs_num=2 if logprobs else 0,
        )  # fmt: skip

    if options.model.is_embedding:
        params = SamplingParams(max_new_tokens=0)
        yield [
            TokenizedRequest(f"warm-up-{i}", ids[: PROMPT_TOKENS + i], params, seed=i, embed=True)
            for i in range(rows)
        ]
        return
    prompts = [ids[i % 16 : i % 16 + PROMPT_TOKENS] for i in range(rows)]
    yield [request(p, logprobs=True, temperature=1.0) for p in prompts] + [request(prompts[0])]
    # A sampling kernel's variant is the batch's (a filter any row uses): a phase each.
    for k in range(1, len(FILTERS) + 1):
        for names in combinations(FILTERS, k):
            yield [request(p, temperature=0.8, **{n: FILTERS[n] for n in names}) for p in prompts]
    # Batches of a few rows: the LM head's small-batch GEMM kernel has a variant for one row,
    # for a multiple of 16 rows and for any other count (what Triton specializes integers on);
    # one row is the prefix phase's.
    yield [request(p) for p in prompts[:2]]
    yield [request(p) for p in prompts[:16]]
    penalties = {"repetition_penalty": 1.1, "frequency_penalty": 0.1, "presence_penalty": 0.1}
    yield [request(p, temperature=0.8, logit_bias={1: 1.0}, **penalties) for p in prompts]
    # A prefill over a cached prefix: the prefix, then a prompt that extends it.
    yield [request(ids[:prefix])]
    yield [request(ids, logprobs=True)]
    # A decode batch past the largest CUDA graph runs eagerly.
    graphs = runner.graph_runner
    largest = graphs.sizes[-1] if graphs is not None else options.scheduler.max_running_requests
    fits = (largest + 1) * (PROMPT_TOKENS + 2) <= runner.num_slots // 2
    if largest < options.scheduler.max_running_requests and fits:
        yield [request(prompts[i % rows], temperature=1.0) for i in range(largest + 1)]
    # An extend past the largest extend graph runs eagerly: one prompt that long.
    sched = options.scheduler
    bound = min(room, sched.chunked_prefill_size, sched.max_prefill_tokens, runner.num_slots // 2)
    if runner.extend_graphs is not None and runner.extend_graphs.buckets[-1] < bound:
        long = runner.extend_graphs.buckets[-1] + 1
        yield [request([(5 + 11 * i) % vocab for i in range(long)])]  # nothing of it cached
    # With the all-reduce fused into the norms, a step of more rows than the fused kernel
    # takes runs the all-reduce and the norm's own kernel apart: one prefill that long.
    if runner.kernel_plan.allreduce_fusion:
        long = FUSED_MAX_TOKENS + 1
        if long <= bound:
            yield [request([(11 + 17 * i) % vocab for i in range(long)])]  # nothing of it cached
