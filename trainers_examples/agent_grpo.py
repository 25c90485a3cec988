"""Multi-turn, tool-using GRPO: the policy must call a tool, read its result and answer with it.

Each episode is one engine session (rollout.trajectory.SessionRollout), token in / token out:
  turn 1  the prompt asks for a secret number; the policy calls the lookup tool by writing a
          digit token (the tool's argument, which this toy tool ignores) within a few tokens;
  tool    the environment appends the tool's answer as ids (nothing is re-tokenized):
          `<|im_end|>` and a `tool` chat turn whose last token is the secret, 0, 1 or 2;
  turn 2  the policy answers with one token right after it; right when it is the secret.
The reward is 0.1 for calling the tool, 0.1 for answering with one of the tool's numbers and
0.8 for the right one, so a random model starts near 0 and a policy that learned to call,
read and copy scores 1. The secret is drawn per episode: without reading the tool's answer a
policy scores at most 0.1 + 0.1 + 0.8 / 3.

The trainer gets each episode as one trajectory: every token id, the loss mask (1 on the
tokens the policy sampled in either turn, 0 on the prompt and the tool's tokens), the
sampling logprobs and weight versions, aligned. The update is grpo.py's PPO-clip with
group-normalized advantages, taken only over the masked tokens, plus an exploration prior at
the answer that fades out over the run (--prior-coef): the mean log-probability of the numbers
the tool can return. Without it the answer collapses onto the numbers a random model happens
to write while the policy learns to call, and a number it never writes is never found. The
weight push is grpo.py's.

    python trainers_examples/agent_grpo.py    # a tiny random model, CPU: about a minute

Ends by printing one JSON line (steps, first_reward, final_reward, call_rate, ...), as
grpo.py does.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from typing import Any

import torch
from example_setup import (
    add_arguments,
    checkpoint,
    engine_options,
    load_policy,
    resolve_devices,
)
from grpo import ppo_clip_loss, train_and_push
from rollout_batch import RolloutBatch, TokenBatch
from run_log import RunLog
from toy_task import DigitTask

from rollout.trajectory import SessionRollout, Trajectory, run_turns

DEFAULTS = {
    "steps": 30,
    "prompts_per_step": 8,
    "n": 16,
    "max_new_tokens": 4,  # turn 1: tokens the policy has to call the tool
    "lr": 5e-3,
    "minibatches": 4,
}
QUESTION = "Look up the secret number with the tool, then tell me the number."
NUM_SECRETS = 3  # the tool answers "0", "1" or "2"
CALL_REWARD, NUMBER_REWARD, RIGHT_REWARD = 0.1, 0.1, 0.8


class ToolTask:
    """The prompt, the tool's answer and the reward, in token ids."""

    def __init__(self, tokenizer: Any) -> None:
        digits = DigitTask(tokenizer)
        self.prompt = digits.encode(QUESTION)
        # Single-token digits "0".."9": a tool call is any of them, a secret one of the first.
        self.digits = sorted(i for i in digits.digit_ids if len(tokenizer.decode([i]).strip()) == 1)
        self.digit_set = frozenset(digits.digit_ids)
        self.secrets = self.digits[:NUM_SECRETS]
        encode = functools.partial(tokenizer.encode, add_special_tokens=False)
        self.tool_head = encode("<|im_end|>\n<|im_start|>tool\nThe secret number is ")

    def called(self, output_ids: list[int]) -> bool:
        return bool(output_ids) and output_ids[-1] in self.digit_set

    def tool_answer(self, secret: int) -> list[int]:
        return self.tool_head + [secret]

    def reward(self, called: bool, answer: list[int], secret: int) -> float:
        if not called or not answer:
            return 0.0
        number = answer[0] in self.secrets
        return CALL_REWARD + NUMBER_REWARD * number + RIGHT_REWARD * (answer[0] == secret)


class PolicyWithPrior(torch.nn.Module):
    """The policy; each forward also keeps `prior` [B, L-1], the mean log-probability that each
    position's distribution gives the numbers the tool can return."""

    def __init__(self, policy: torch.nn.Module, numbers: list[int]) -> None:
        super().__init__()
        self.policy, self.numbers = policy, numbers
        self.prior: torch.Tensor | None = None

    def forward(self, **inputs: Any) -> Any:
        out = self.policy(**inputs)
        logprobs = out.logits[:, :-1].float().log_softmax(-1)  # [B, L-1, V]
        self.prior = logprobs[..., self.numbers].mean(-1)
        return out


def answer_positions(mask: torch.Tensor) -> torch.Tensor:
    """[B, L-1] 1 where the policy's second turn (the answer) is predicted: the masked
    positions of each row's second run of masked positions."""
    before = torch.nn.functional.pad(mask[:, :-1], (1, 0))
    runs = (mask * (1 - before)).cumsum(-1)  # which run of masked positions each one is in
    return mask * (runs == 2)


def agent_loss(
    logprobs: torch.Tensor, t: TokenBatch, clip: float, prior_coef: float, policy: PolicyWithPrior
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """grpo.py's PPO-clip, per token, minus prior_coef x the answer's prior (see
    PolicyWithPrior, whose forward made `logprobs`)."""
    loss, stats = ppo_clip_loss(logprobs, t, clip)
    return loss - prior_coef * answer_positions(t.mask) * policy.prior, stats


class TrajectoryBatch(RolloutBatch):
    """RolloutBatch over multi-turn trajectories: the loss covers the masked tokens only.
    `output_ids` holds each trajectory's policy tokens (what the loss is averaged over)."""

    def __init__(self, trajectories: list[Trajectory], rewards: torch.Tensor, n: int) -> None:
        policy = [t.policy_ids for t in trajectories]
        logprobs = [[lp for lp, m in zip(t.logprobs, t.loss_mask) if m] for t in trajectories]
        super().__init__([[] for _ in trajectories], policy, logprobs, rewards, n)
        self.trajectories = trajectories

    def tensors(
        self, index: list[int], advantages: torch.Tensor, device: torch.device | str
    ) -> TokenBatch:
        trajs = [self.trajectories[i] for i in index]
        length = max(len(t) for t in trajs)
        input_ids = torch.zeros(len(index), length, dtype=torch.long)
        attention_mask = torch.zeros(len(index), length, dtype=torch.long)
        mask = torch.zeros(len(index), length - 1)
        old = torch.zeros(len(index), length - 1)
        for row, t in enumerate(trajs):
            input_ids[row, : len(t)] = torch.tensor(t.token_ids)
            attention_mask[row, : len(t)] = 1
            # Position p predicts token p + 1: its mask and logprob are token p + 1's.
            mask[row, : len(t) - 1] = torch.tensor(t.loss_mask[1:], dtype=torch.float32)
            old[row, : len(t) - 1] = torch.tensor(t.logprobs[1:])
        return TokenBatch(
            input_ids.to(device), attention_mask.to(device), mask.to(device), old.to(device),
            advantages[index].to(device),
        )  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser, DEFAULTS)
    parser.add_argument(
        "--prior-coef", type=float, default=0.1,
        help="weight of the answer's exploration prior at the first step, fading linearly to 0 "
        "at the last",
    )  # fmt: skip
    args = parser.parse_args(argv)
    resolve_devices(args)
    return args


def rollouts(
    engine: Any, task: ToolTask, args: argparse.Namespace, step: int, version: str
) -> tuple[list[Trajectory], list[float], dict[str, float]]:
    """One step's episodes (prompts_per_step groups of n, group-major): their trajectories,
    rewards and the step's call and right-answer rates."""
    count = args.prompts_per_step * args.n
    rng = random.Random(args.seed * 1_000_003 + step)
    secrets = [rng.choice(task.secrets) for _ in range(count)]
    seed = (args.seed * 1_000_003 + step) * count * 2
    sample = {"temperature": 1.0, "seed": seed}
    episodes = [SessionRollout(engine) for _ in range(count)]
    try:
        call_params = {
            **sample,
            "max_new_tokens": args.max_new_tokens,
            "stop_token_ids": task.digits,
        }
        params = [{**call_params, "seed": seed + i} for i in range(count)]
        first = run_turns(engine, episodes, [task.prompt] * count, params)
        called = [task.called(out["output_ids"]) for out in first]
        todo = [i for i in range(count) if called[i]]
        answers: dict[int, list[int]] = {}
        answer_params = [{**sample, "max_new_tokens": 1, "seed": seed + count + i} for i in todo]
        tool = [task.tool_answer(secrets[i]) for i in todo]
        for i, out in zip(
            todo, run_turns(engine, [episodes[i] for i in todo], tool, answer_params)
        ):
            answers[i] = out["output_ids"]
    finally:
        for episode in episodes:
            episode.close()
    trajectories = [e.trajectory for e in episodes]
    stale = {v for t in trajectories for v in t.weight_versions if v is not None} - {version}
    if stale:
        raise RuntimeError(f"rollouts came from weights {stale}, not {version!r}")
    rewards = [task.reward(called[i], answers.get(i, []), secrets[i]) for i in range(count)]
    right = sum(answers.get(i, [None])[0] == secrets[i] for i in range(count))
    return trajectories, rewards, {"call_rate": len(todo) / count, "right_rate": right / count}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    with checkpoint(args) as model_path:
        policy = load_policy(model_path, args.trainer_device, args.trainer_dtype)
        from rollout import RolloutEngine

        with RolloutEngine(model_path, **engine_options(args)) as engine:
            return train(args, engine, policy)


def train(args: argparse.Namespace, engine: Any, policy: torch.nn.Module) -> dict:
    from rollout.weight_sync.sender import WeightSender

    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sender = WeightSender(engine, method="tensor")
    task = ToolTask(engine.tokenizer)
    with_prior = PolicyWithPrior(policy, task.secrets)
    log = RunLog("agent_grpo", vars(args), args.log_dir, use_wandb=not args.no_wandb)
    version = engine.get_weight_version()
    try:
        for step in log.steps(args.steps):
            coef = args.prior_coef * (1 - step / args.steps)
            token_loss = functools.partial(
                agent_loss, clip=args.clip, prior_coef=coef, policy=with_prior
            )
            start = time.perf_counter()
            trajectories, rewards, rates = rollouts(engine, task, args, step, version)
            rollout_s = time.perf_counter() - start
            batch = TrajectoryBatch(trajectories, torch.tensor(rewards), args.n)

            version = f"step-{step + 1}"
            stats = train_and_push(
                engine, sender, policy, optimizer, batch, token_loss, args, version, with_prior
            )
            log.log(
                step + 1, {"rollout_tokens_per_s": batch.num_tokens / rollout_s, **rates, **stats}
            )
    finally:
        sender.close()
    final = log.history[-1] if log.history else {}
    return log.finish(
        weight_version=version,
        call_rate=final.get("call_rate"),
        right_rate=final.get("right_rate"),
    )


if __name__ == "__main__":
    main()
