"""One step's rollouts as the trainer sees them: samples, rewards, group advantages, tensors.

The engine's outputs (SGLang's dicts, prompt-major, n per prompt) carry the sampled tokens and
their logprobs under the weights that generated them: the behaviour policy's logprobs, which
the importance ratio needs, so the trainer never runs a separate "old policy" forward.

With truncated importance sampling (`--tis-cap C`, as verl and slime apply it) the ratio is
taken against the trainer's own logprobs of the rollout weights (measured by `logprob_gap`),
and each token's loss is weighted by min(exp(trainer - engine), C): the correction for what
inference computes differently from training.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass
class TokenBatch:
    """Padded tensors for a few samples. Position t of the [B, L-1] tensors is the prediction
    of token t+1 from the tokens up to t; `mask` marks the generated tokens among them."""

    input_ids: torch.Tensor  # [B, L] prompt + output, right-padded
    attention_mask: torch.Tensor  # [B, L]
    mask: torch.Tensor  # [B, L-1] float, 1 on generated tokens
    old_logprobs: torch.Tensor  # [B, L-1] the engine's logprobs (with TIS: the trainer's), 0 off the mask
    advantages: torch.Tensor  # [B]
    # With TIS: min(exp(trainer - engine logprob), cap) per token, 0 off the mask; else None.
    tis_weights: torch.Tensor | None = None


@dataclass
class Minibatch:
    """The samples of one optimizer step, as micro-batches (one forward each)."""

    micro_batches: list[TokenBatch]
    num_tokens: int  # generated tokens in the whole minibatch: the loss is a mean over them


@dataclass
class RolloutBatch:
    prompt_ids: list[list[int]]  # one entry per sample
    output_ids: list[list[int]]
    engine_logprobs: list[list[float]]
    rewards: torch.Tensor  # [P * n]
    n: int
    # The trainer's logprobs of the sampled tokens under the rollout weights (logprob_gap).
    trainer_logprobs: list[list[float]] | None = None

    @classmethod
    def from_outputs(
        cls,
        prompts: list[list[int]],
        outputs: list[dict],
        n: int,
        reward: Callable[[list[int]], float],
    ) -> RolloutBatch:
        """`outputs` as generate(input_ids=prompts, n=n, return_logprob=True) returns them."""
        if len(outputs) != len(prompts) * n:
            raise ValueError(
                f"expected {len(prompts)} prompts x {n} samples, got {len(outputs)} outputs"
            )
        prompt_ids = [prompts[i // n] for i in range(len(outputs))]
        output_ids = [list(o["output_ids"]) for o in outputs]
        # Entries are (logprob, token_id, text): tuples from the engine, lists over HTTP.
        logprobs = [[float(e[0]) for e in o["meta_info"]["output_token_logprobs"]] for o in outputs]
        for ids, lps in zip(output_ids, logprobs):
            if len(ids) != len(lps):
                raise ValueError(f"an output has {len(ids)} tokens but {len(lps)} logprobs")
        rewards = torch.tensor([reward(ids) for ids in output_ids], dtype=torch.float32)
        return cls(prompt_ids, output_ids, logprobs, rewards, n)

    def __len__(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.output_ids)

    def advantages(self, eps: float = 1e-6) -> torch.Tensor:
        """GRPO's advantage: each reward against its own prompt's group, (r - mean) / std.
        A group whose samples all scored the same teaches nothing and gets 0."""
        groups = self.rewards.view(-1, self.n)  # [P, n]
        std = groups.std(dim=1, keepdim=True) if self.n > 1 else torch.ones_like(groups)
        return ((groups - groups.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)  # [P * n]

    def tensors(
        self, index: list[int], advantages: torch.Tensor, device: torch.device | str
    ) -> TokenBatch:
        """The samples at `index` padded into one TokenBatch on `device`."""
        seqs = [self.prompt_ids[i] + self.output_ids[i] for i in index]
        length = max(len(s) for s in seqs)
        input_ids = torch.zeros(len(index), length, dtype=torch.long)
        attention_mask = torch.zeros(len(index), length, dtype=torch.long)
        mask = torch.zeros(len(index), length - 1)
        old = torch.zeros(len(index), length - 1)
        for row, (i, seq) in enumerate(zip(index, seqs)):
            input_ids[row, : len(seq)] = torch.tensor(seq)
            attention_mask[row, : len(seq)] = 1
            start, end = len(self.prompt_ids[i]) - 1, len(seq) - 1
            mask[row, start:end] = 1.0
            old[row, start:end] = torch.tensor(self.engine_logprobs[i])
        return TokenBatch(
            input_ids.to(device), attention_mask.to(device), mask.to(device), old.to(device),
            advantages[index].to(device),
        )  # fmt: skip

    def with_tis(self, t: TokenBatch, index: list[int], cap: float) -> TokenBatch:
        """`t` (samples `index`) for truncated importance sampling: the trainer's logprobs
        (from logprob_gap) as the old ones, and min(exp(trainer - engine), cap) as weights."""
        if self.trainer_logprobs is None:
            raise ValueError("truncated importance sampling needs logprob_gap's trainer logprobs")
        old, weights = t.old_logprobs.clone(), torch.zeros_like(t.old_logprobs)
        for row, i in enumerate(index):
            on = t.mask[row] > 0  # the sampled tokens, in order
            trainer = torch.tensor(self.trainer_logprobs[i], device=old.device)
            weights[row, on] = torch.exp(trainer - old[row, on]).clamp(max=cap)
            old[row, on] = trainer
        return replace(t, old_logprobs=old, tis_weights=weights)

    def minibatches(
        self, count: int, micro_batch: int, device: torch.device | str,
        tis_cap: float | None = None,
    ) -> Iterator[Minibatch]:  # fmt: skip
        """The samples shuffled (torch's generator) into `count` minibatches of micro-batches,
        with GRPO advantages; made one at a time, so only one minibatch is on `device`."""
        advantages = self.advantages()
        order = torch.randperm(len(self)).tolist()
        size = math.ceil(len(self) / count)
        for first in range(0, len(self), size):
            index = order[first : first + size]
            starts = range(0, len(index), micro_batch)
            micro = []
            for m in starts:
                part = index[m : m + micro_batch]
                t = self.tensors(part, advantages, device)
                micro.append(t if tis_cap is None else self.with_tis(t, part, tis_cap))
            yield Minibatch(micro, max(sum(len(self.output_ids[i]) for i in index), 1))


def generate_rollouts(
    engine: Any, prompts: list[list[int]], sampling_params: list[dict], version: str
) -> tuple[list[dict], float]:
    """engine.generate (a RolloutEngine or a RolloutClient) with the sampled tokens' logprobs;
    returns the outputs and the seconds the call took. Raises if an output came from weights
    other than `version`: the ratio would then be taken against the wrong behaviour policy."""
    start = time.perf_counter()
    outputs = engine.generate(
        input_ids=prompts, sampling_params=sampling_params, return_logprob=True
    )
    seconds = time.perf_counter() - start
    stale = {o["meta_info"]["weight_version"] for o in outputs} - {version}
    if stale:
        raise RuntimeError(f"rollouts came from weights {stale}, not {version!r}")
    return outputs, seconds


def optimize(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    token_loss: Callable[[torch.Tensor, TokenBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    args: Any,
) -> dict[str, float]:
    """One optimizer step per minibatch (args.minibatches of them), gradients accumulated over
    its micro-batches. token_loss(logprobs, t), logprobs the policy's [B, L-1] on micro-batch t,
    gives the loss of each token [B, L-1] and per-token statistics of the same shape; the
    gradient is that of the mean loss over the minibatch's generated tokens. Returns "loss" and
    each statistic averaged over the batch's generated tokens."""
    totals: dict[str, float] = {}
    tis_cap = getattr(args, "tis_cap", None)
    for minibatch in batch.minibatches(
        args.minibatches, args.micro_batch, args.trainer_device, tis_cap
    ):
        optimizer.zero_grad(set_to_none=True)
        for t in minibatch.micro_batches:
            loss, stats = token_loss(token_logprobs(policy, t), t)
            ((loss * t.mask).sum() / minibatch.num_tokens).backward()
            for name, value in {"loss": loss, **stats}.items():
                totals[name] = totals.get(name, 0.0) + (value.detach() * t.mask).sum().item()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        optimizer.step()
    return {name: total / max(batch.num_tokens, 1) for name, total in totals.items()}


def token_logprobs(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """[B, L-1] log-probabilities the model gives each next token (float32, raw logits: no
    temperature, as the engine reports them). A model with its own padded_token_logprobs (the
    parity model, rollout.parity) computes them as the engine does."""
    if hasattr(model, "padded_token_logprobs"):
        return model.padded_token_logprobs(batch.input_ids, batch.attention_mask)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[:, :-1].float()  # [B, L-1, V]
    targets = batch.input_ids[:, 1:].unsqueeze(-1)  # [B, L-1, 1]
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


# A token's probability ratio trainer / engine counts as off when outside this range.
RATIO_RANGE = (0.8, 1.25)


@torch.no_grad()
def logprob_gap(
    model: torch.nn.Module, batch: RolloutBatch, micro_batch: int, device: torch.device | str
) -> dict[str, float]:
    """How far inference drifts from training on every sampled token, the trainer on the
    weights the engine sampled with (0 up to rounding in float32): "logprob_gap", the mean
    |engine logprob - trainer logprob|; "logprob_gap_max", the largest; "ratio_off", the
    fraction of tokens whose probability ratio exp(trainer - engine) is outside RATIO_RANGE.
    Keeps the trainer's logprobs in batch.trainer_logprobs (for truncated importance sampling)."""
    total, largest, off, count = 0.0, 0.0, 0, 0
    zeros, trainer = torch.zeros(len(batch)), []
    low, high = (math.log(r) for r in RATIO_RANGE)
    for start in range(0, len(batch), micro_batch):
        index = list(range(start, min(start + micro_batch, len(batch))))
        t = batch.tensors(index, zeros, device)
        logprobs = token_logprobs(model, t)
        delta = (logprobs - t.old_logprobs) * t.mask
        total += delta.abs().sum().item()
        largest = max(largest, delta.abs().max().item())
        off += (((delta < low) | (delta > high)) & (t.mask > 0)).sum().item()
        count += int(t.mask.sum().item())
        for row in range(len(index)):  # the sampled tokens' positions, in order
            trainer.append(logprobs[row][t.mask[row] > 0].tolist())
    batch.trainer_logprobs = trainer
    n = max(count, 1)
    return {"logprob_gap": total / n, "logprob_gap_max": largest, "ratio_off": off / n}
