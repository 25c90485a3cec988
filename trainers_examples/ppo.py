"""RLHF-style PPO: rewards from a reward model served by a second engine, through /classify.

The policy's engine is colocated (a RolloutEngine in this process, as in grpo.py); the reward
model runs in its own `rollout serve --is-embedding` process, started here (or --reward-url).
Without --reward-model-path a tiny classifier is first fitted to the toy task's rule (the
fraction of digit tokens; reward_model.py) so that its scores mean something. Each step:
  1. rollouts: n samples per prompt from the engine, with the logprobs of the sampled tokens;
  2. rewards: every (question, answer) chat scored by the reward model in one /classify call,
     group-normalized into advantages. The rule's reward is computed too, only to be logged;
  3. the engine releases its memory for the training phase;
  4. PPO-clip (grpo.py's) plus a KL penalty to the initial policy, the usual guard against a
     policy that drifts to where a learned reward model is wrong;
  5. the new weights are pushed into the engine (update_weights_from_tensor).

With the defaults the policy learns the task on a 2-core CPU in well under a minute, most of
it spent fitting the reward model: the rule's mean reward goes from about 0.01 to above 0.9,
the reward model's from under 0.1 to above 0.8. On a GPU, with real models (the reward model a
Qwen3/Qwen2/Llama *ForSequenceClassification checkpoint):

    python trainers_examples/ppo.py --model-path /path/to/Qwen3-0.6B \\
        --reward-model-path /path/to/reward-model --device cuda --dtype bfloat16 \\
        --reward-dtype bfloat16 --engine-option mem_fraction=0.4 --reward-option mem_fraction=0.2 \\
        --max-new-tokens 256 --lr 1e-6 --steps 200

Run with --help for every flag. Ends by printing one JSON line (steps, first_reward,
final_reward, mean_logprob_gap, rule_rewards, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import time

import torch
from example_setup import (
    add_arguments,
    checkpoint,
    engine_options,
    load_policy,
    push_weights,
    resolve_devices,
    sampling_params,
)
from grpo import DEFAULTS, ppo_clip_loss
from reward_model import add_reward_arguments, reward_checkpoint, score, server_options
from rollout_batch import (
    RolloutBatch,
    TokenBatch,
    generate_rollouts,
    logprob_gap,
    optimize,
    token_logprobs,
)
from run_log import RunLog
from server_process import serve
from toy_task import DigitTask


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser, DEFAULTS)  # grpo.py's: the same task, tuned the same way
    parser.add_argument("--kl-coef", type=float, default=0.01, help="KL penalty; 0: no reference")
    parser.add_argument("--bucket-mb", type=int, default=512, help="weight push buckets, MiB")
    add_reward_arguments(parser)
    args = parser.parse_args(argv)
    resolve_devices(args)
    args.reward_device = args.reward_device or args.device
    if args.reward_url and not args.reward_model_path:
        parser.error("--reward-url needs --reward-model-path (the checkpoint the server serves)")
    if args.rm_steps < 0 or args.rm_batch < 2:
        parser.error(
            f"--rm-steps must be >= 0, --rm-batch >= 2; got {args.rm_steps}, {args.rm_batch}"
        )
    return args


def ppo_kl_loss(
    logprobs: torch.Tensor,
    t: TokenBatch,
    reference: torch.nn.Module | None,
    args: argparse.Namespace,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per token [B, L-1]: grpo.py's PPO-clip loss + kl_coef * KL(policy || reference).
    logprobs: [B, L-1], the policy's (token_logprobs)."""
    loss, stats = ppo_clip_loss(logprobs, t, args.clip)
    if reference is None:
        return loss, stats
    with torch.no_grad():
        reference_logprobs = token_logprobs(reference, t)
    # k3 estimator on the sampled token: exp(r) - r - 1 >= 0, r = log reference / policy prob.
    log_ratio = (reference_logprobs - logprobs).clamp(-20.0, 20.0)
    kl = torch.exp(log_ratio) - log_ratio - 1
    return loss + args.kl_coef * kl, {**stats, "kl": kl.detach()}


def correlation(pairs: list[tuple[float, float]]) -> float | None:
    """Pearson's r of the pairs: how well the reward model tracked the rule on the policy's own
    samples. None while it is undefined (one of them constant, as the rule is at first)."""
    r = torch.corrcoef(torch.tensor(pairs).T)[0, 1].item()
    return None if r != r else r


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    from transformers import AutoTokenizer

    from rollout import RolloutEngine
    from rollout.client import RolloutClient
    from rollout.weight_sync.sender import WeightSender

    # Closed in reverse: the engine, the reward server, then the checkpoints' directories.
    with contextlib.ExitStack() as stack:
        model_path = stack.enter_context(checkpoint(args))
        task = DigitTask(AutoTokenizer.from_pretrained(model_path))
        reward_path, fit = stack.enter_context(reward_checkpoint(args, task))
        reward_url = args.reward_url or stack.enter_context(
            serve(reward_path, server_options(args), args.reward_api_key, args.server_timeout)
        )
        reward_client = stack.enter_context(RolloutClient(reward_url, api_key=args.reward_api_key))
        engine = stack.enter_context(RolloutEngine(model_path, **engine_options(args)))

        policy = load_policy(model_path, args.trainer_device, args.trainer_dtype)
        reference = None  # the initial policy, frozen, for the KL penalty
        if args.kl_coef > 0:
            reference = load_policy(model_path, args.trainer_device, args.trainer_dtype)
            reference.requires_grad_(False)
        optimizer = torch.optim.AdamW(
            policy.parameters(), lr=args.lr, weight_decay=args.weight_decay
        )
        sender = WeightSender(engine, method="tensor", bucket_bytes=args.bucket_mb << 20)
        stack.callback(sender.close)
        log = RunLog("ppo", vars(args), args.log_dir, use_wandb=not args.no_wandb)
        token_loss = functools.partial(ppo_kl_loss, reference=reference, args=args)
        version = engine.get_weight_version()
        scored: list[tuple[float, float]] = []  # (reward model, rule) of every sample
        for step in log.steps(args.steps):
            questions = task.questions(args.prompts_per_step, step)
            prompts = [task.encode(q) for q in questions]
            params = sampling_params(args, len(prompts), step)
            outputs, rollout_s = generate_rollouts(engine, prompts, params, version)
            by_rule = RolloutBatch.from_outputs(prompts, outputs, args.n, task.reward)
            start = time.perf_counter()
            asked = [q for q in questions for _ in range(args.n)]  # each sample's question
            rewards = score(reward_client, task, asked, by_rule.output_ids)
            reward_s = time.perf_counter() - start
            # The policy learns from the reward model only; the rule's rewards are just logged.
            batch = dataclasses.replace(by_rule, rewards=rewards)
            scored += zip(rewards.tolist(), by_rule.rewards.tolist())

            engine.release_memory_occupation()  # the training phase has the device to itself
            gap = logprob_gap(policy, batch, args.micro_batch, args.trainer_device)
            stats = optimize(policy, optimizer, batch, token_loss, args)
            version = f"step-{step + 1}"
            sync_s = push_weights(engine, sender, policy, version)

            log.log(step + 1, {
                "reward": rewards.mean().item(),
                "rule_reward": by_rule.rewards.mean().item(),
                **gap,
                "weight_sync_s": sync_s,
                "rollout_tokens_per_s": batch.num_tokens / rollout_s,
                "reward_s": reward_s,
                **stats,
            })  # fmt: skip
        rule_rewards = [h["rule_reward"] for h in log.history]
        return log.finish(
            weight_version=version,
            first_rule_reward=rule_rewards[0],
            final_rule_reward=rule_rewards[-1],
            rule_rewards=[round(r, 4) for r in rule_rewards],
            reward_rule_corr=correlation(scored),
            **fit,
        )


if __name__ == "__main__":
    main()
