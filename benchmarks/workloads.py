"""The offline workloads (bench_offline.py's doc describes each), drawn from seeded streams:
the same prompts and lengths in every script that runs them (bench_offline, simulate_schedule,
profile_workload). Each returns (prompts, sampling params), one params dict per prompt."""

from __future__ import annotations

import math
import random

Workload = tuple[list[list[int]], list[dict]]
TOKEN_ID_HIGH = 10000  # nano-vllm draws randint(0, 10000)
NANO_MIN_LEN = 100  # nano-vllm's prompt and output lengths are uniform in 100..max_len
GRPO_PROMPT_LENS = (64, 512)
RL_PROMPT_LENS = (512, 1024)
RL_GROUP = 8  # samples of each prompt (a GRPO group)
RL_MEDIAN_FRACTION, RL_SIGMA = 0.2, 1.0  # lognormal output lengths: median max_len / 5
# One turn of many agent trajectories: contexts lognormal with median max_len / 16, replies
# uniform in AGENT_REPLY_LENS.
AGENT_MEDIAN_FRACTION, AGENT_SIGMA = 1 / 16, 1.5
AGENT_REPLY_LENS = (128, 512)
WORKLOADS = ("nano", "grpo", "fixed", "random", "rl", "agent")
DEFAULT_NUM_SEQS = {"nano": 256, "grpo": 64, "fixed": 64, "random": 500, "rl": 128, "agent": 256}
DEFAULT_MAX_LEN = {
    "nano": 1024, "grpo": 512, "fixed": 256, "random": 1024, "rl": 4096, "agent": 16384,
}  # fmt: skip
PROMPT_LENS = {"grpo": GRPO_PROMPT_LENS, "rl": RL_PROMPT_LENS}  # prompts of their own
MAX_LEN_ONLY = ("nano", "grpo", "rl", "agent")  # sized by --max-len alone


def longest_lengths(workload: str, max_len: int) -> tuple[int, int]:
    """The longest prompt and output of a MAX_LEN_ONLY workload at `max_len`: nano's both,
    grpo's and rl's output (their prompts are their own), agent's prompt (its replies are)."""
    if workload == "nano":
        return max_len, max_len
    if workload == "agent":
        return max_len, AGENT_REPLY_LENS[1]
    return PROMPT_LENS[workload][1], max_len


def token_ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    # Drawn as nano-vllm does, then folded into the vocabulary: the random stream (and with it
    # every later length) is the same whatever the model.
    return [rng.randint(0, TOKEN_ID_HIGH) % vocab_size for _ in range(count)]


def nano_workload(num_seqs: int, max_len: int, vocab_size: int) -> Workload:
    rng = random.Random(0)
    prompts = [
        token_ids(rng, rng.randint(NANO_MIN_LEN, max_len), vocab_size) for _ in range(num_seqs)
    ]
    params = [
        {"temperature": 0.6, "ignore_eos": True, "max_new_tokens": output_len}
        for output_len in (rng.randint(NANO_MIN_LEN, max_len) for _ in range(num_seqs))
    ]
    return prompts, params


def grpo_workload(num_prompts: int, output_len: int, vocab_size: int) -> Workload:
    rng = random.Random(0)
    prompts = [
        token_ids(rng, rng.randint(*GRPO_PROMPT_LENS), vocab_size) for _ in range(num_prompts)
    ]
    params = [
        {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": output_len, "n": 8}
        for _ in range(num_prompts)
    ]
    return prompts, params


def fixed_workload(num_seqs: int, input_len: int, output_len: int, vocab_size: int) -> Workload:
    rng = random.Random(0)
    prompts = [token_ids(rng, input_len, vocab_size) for _ in range(num_seqs)]
    params = [
        {"temperature": 0, "ignore_eos": True, "max_new_tokens": output_len}
        for _ in range(num_seqs)
    ]
    return prompts, params


def random_workload(
    num_seqs: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int
) -> Workload:
    rng = random.Random(0)
    prompts, params = [], []
    for _ in range(num_seqs):
        n_in = rng.randint(max(int(input_len * range_ratio), 1), input_len)
        n_out = rng.randint(max(int(output_len * range_ratio), 1), output_len)
        prompts.append(token_ids(rng, n_in, vocab_size))
        params.append({"temperature": 0, "ignore_eos": True, "max_new_tokens": n_out})
    return prompts, params


def rl_workload(num_prompts: int, max_output_len: int, vocab_size: int) -> Workload:
    """RL_GROUP requests per prompt, each with its own output length (see the module doc)."""
    rng = random.Random(0)
    prompts = [token_ids(rng, rng.randint(*RL_PROMPT_LENS), vocab_size) for _ in range(num_prompts)]
    median = math.log(max_output_len * RL_MEDIAN_FRACTION)
    lengths = [
        min(max(round(rng.lognormvariate(median, RL_SIGMA)), 1), max_output_len)
        for _ in range(num_prompts * RL_GROUP)
    ]
    samples = [list(p) for p in prompts for _ in range(RL_GROUP)]
    params = [{"temperature": 1.0, "ignore_eos": True, "max_new_tokens": n} for n in lengths]
    return samples, params


def agent_workload(num_seqs: int, max_context_len: int, vocab_size: int) -> Workload:
    """num_seqs agent trajectories at their next turn: each prompt is a conversation grown to its
    own length (many short, a few near max_context_len), each reply AGENT_REPLY_LENS long."""
    rng = random.Random(0)
    median = math.log(max_context_len * AGENT_MEDIAN_FRACTION)
    lengths = [
        min(max(round(rng.lognormvariate(median, AGENT_SIGMA)), 1), max_context_len)
        for _ in range(num_seqs)
    ]
    prompts = [token_ids(rng, n, vocab_size) for n in lengths]
    params = [
        {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": rng.randint(*AGENT_REPLY_LENS)}
        for _ in range(num_seqs)
    ]
    return prompts, params


def draw(
    workload: str,
    num_seqs: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = 0.0,
) -> Workload:
    """`workload` with input_len and output_len the longest prompt and output it may make: nano
    takes output_len as its max_len (prompts as long), grpo and rl their output length (their
    prompts are their own), agent input_len as its longest context (replies are its own)."""
    if workload == "nano":
        return nano_workload(num_seqs, output_len, vocab_size)
    if workload == "grpo":
        return grpo_workload(num_seqs, output_len, vocab_size)
    if workload == "rl":
        return rl_workload(num_seqs, output_len, vocab_size)
    if workload == "agent":
        return agent_workload(num_seqs, input_len, vocab_size)
    if workload == "fixed":
        return fixed_workload(num_seqs, input_len, output_len, vocab_size)
    if workload == "random":
        return random_workload(num_seqs, input_len, output_len, range_ratio, vocab_size)
    raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")
