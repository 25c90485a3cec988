"""Colocated GRPO: the trainer and a RolloutEngine in one script.

Each step:
  1. rollouts: n samples per prompt from the engine, with the logprobs of the sampled tokens;
  2. a rule-based reward (toy_task.py: the fraction of digit tokens) and group-normalized
     advantages;
  3. the engine releases its memory (KV cache, weights, CUDA graphs) for the training phase;
  4. a PPO-clip policy update whose importance ratio is taken against the engine's logprobs;
  5. the engine resumes its weights' memory, the new weights are pushed in through
     update_weights_from_tensor (bucketed by WeightSender), then the KV cache comes back.

With the defaults a tiny random model learns the toy task on a CPU in well under a minute:
the mean reward goes from about 0.01 to above 0.8. On a GPU, for a real model:

    python trainers_examples/grpo.py --model-path /path/to/Qwen3-0.6B --device cuda \
        --dtype bfloat16 --max-new-tokens 64 --lr 1e-6 --steps 200

With --replicas N the rollouts come from a RolloutPool of N engines (Ray actors; a local Ray
cluster unless --ray-address names one: pip install -e ".[ray]"): each step's prompts are
spread over the replicas, every push reaches all of them at once, and a replica that dies is
restarted with the trainer's current weights. On one GPU, give each replica its share of the
memory: --replicas 2 --engine-option mem_fraction=0.4.

With --parity the trainer scores rollouts with rollout.parity.ParityModel over the policy's own
parameters, and the engine runs with enable_deterministic_inference: both run the same
batch-invariant kernels, so the logprob gap is exactly 0 at every step (on a CPU the kernels
run under Triton's interpreter, slowly: try --steps 3 --prompts-per-step 2 --n 4).

With --lora-rank R the policy is a LoRA adapter of rank R trained with PEFT (lora_policy.py):
the engine serves it as adapter "policy" and each step's push sends the adapter alone.

Run with --help for every flag. The run's offline wandb run and a PNG of reward and logprob gap
per step go to --log-dir (default ./runs/grpo-<date>-<time>; run_log.py). Ends by printing one
JSON line (steps, first_reward, final_reward, mean_logprob_gap, ...).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
from typing import Any

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
from lora_policy import adapter_engine, add_lora_arguments, check_lora_arguments, wrap_policy
from rollout_batch import (
    RolloutBatch,
    TokenBatch,
    generate_rollouts,
    logprob_gap,
    optimize,
)
from run_log import RunLog
from toy_task import DigitTask

DEFAULTS = {
    "steps": 20,
    "prompts_per_step": 8,
    "n": 8,
    "max_new_tokens": 8,
    "lr": 5e-3,
    "minibatches": 2,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser, DEFAULTS)
    parser.add_argument(
        "--bucket-mb", type=int, default=512, help="size of the weight push buckets, MiB"
    )
    parser.add_argument(
        "--replicas", type=int, default=0,
        help="generate with a RolloutPool of this many engine replicas on Ray (0: one engine)",
    )  # fmt: skip
    parser.add_argument(
        "--ray-address", help="with --replicas: the Ray cluster to join (default: start one)"
    )
    parser.add_argument(
        "--parity", action="store_true",
        help="score rollouts with the parity model (the engine's kernels, rollout.parity) and "
        "generate with enable_deterministic_inference: a logprob gap of exactly 0",
    )  # fmt: skip
    add_lora_arguments(parser)
    args = parser.parse_args(argv)
    if args.replicas < 0:
        raise SystemExit(f"--replicas must be >= 0, got {args.replicas}")
    check_lora_arguments(args, DEFAULTS["lr"])
    resolve_devices(args)
    if args.parity:
        check_parity_arguments(args)
    return args


def check_parity_arguments(args: argparse.Namespace) -> None:
    """--parity: the engine gets enable_deterministic_inference; the trainer must compute in
    the engine's dtype on the engine's kind of device, or the bits cannot agree."""
    if args.lora_rank:
        raise SystemExit(
            "--parity does not support --lora-rank (adapters are not batch-invariant yet)"
        )
    if args.trainer_dtype != args.dtype:
        raise SystemExit(
            f"--parity needs --trainer-dtype equal to --dtype, got {args.trainer_dtype} and {args.dtype}"
        )
    if str(args.trainer_device).split(":")[0] != str(args.device).split(":")[0]:
        raise SystemExit(
            f"--parity needs the trainer on the engine's kind of device, got {args.trainer_device} "
            f"and {args.device}"
        )
    if importlib.util.find_spec("triton") is None:
        raise SystemExit(
            "--parity runs the engine's Triton kernels in the trainer too: pip install triton"
        )
    args.engine_option.append("enable_deterministic_inference=true")
    if args.device == "cpu":  # the kernels run under Triton's interpreter, here and in the engine
        os.environ.setdefault("TRITON_INTERPRET", "1")


def ppo_clip_loss(
    logprobs: torch.Tensor, t: TokenBatch, clip: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip, per token: -min(ratio * A, clip(ratio, 1 - clip, 1 + clip) * A), where ratio is
    the trainer's / the engine's probability of the sampled token: 1 up to rounding on the first
    minibatch, then it moves as the policy does, and the clip bounds how far one step can push
    it. logprobs: [B, L-1], the trainer's (token_logprobs). Also gives clip_frac per token."""
    # Clamped before exp so that a token the engine found very unlikely cannot give inf.
    ratio = torch.exp((logprobs - t.old_logprobs).clamp(-20.0, 20.0))  # [B, L-1]
    adv = t.advantages[:, None]  # [B, 1]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    if t.tis_weights is not None:  # truncated importance sampling: engine -> trainer correction
        surrogate = surrogate * t.tis_weights
    return -surrogate, {"clip_frac": ((ratio - 1).abs() > clip).float()}


def make_engine(args: argparse.Namespace, model_path: str, policy: torch.nn.Module) -> Any:
    """One RolloutEngine, or with --replicas a RolloutPool: the same methods either way."""
    if not args.replicas:
        from rollout import RolloutEngine

        return RolloutEngine(model_path, **engine_options(args))
    from rollout.pool import PoolOptions, RolloutPool

    on_gpu = str(args.device).startswith("cuda")
    # Replicas share the GPUs there are (each then needs a mem_fraction to match).
    gpus = min(1.0, torch.cuda.device_count() / args.replicas) if on_gpu else None
    # A replica that restarts gets the policy's weights: the trainer holds them anyway, so the
    # pool keeps no copy of each push.
    options = PoolOptions(keep_tensor_snapshot=False, restore_weights=lambda: policy)
    return RolloutPool(
        model_path, replicas=args.replicas, ray_address=args.ray_address,
        num_gpus_per_replica=gpus, pool_options=options, **engine_options(args),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    with checkpoint(args) as model_path:
        policy = load_policy(model_path, args.trainer_device, args.trainer_dtype)
        if args.lora_rank:  # a LoRA policy: the engine serves its adapter (lora_policy.py)
            policy = wrap_policy(policy, args)
            with adapter_engine(model_path, policy, engine_options(args), args.lora_rank) as engine:
                return train(args, engine, policy)
        with make_engine(args, model_path, policy) as engine:
            return train(args, engine, policy)


def train(args: argparse.Namespace, engine: Any, policy: torch.nn.Module) -> dict:
    from rollout.weight_sync.sender import WeightSender

    scorer = None
    if args.parity:  # the trainer's forward on the engine's kernels, over the policy's parameters
        from rollout.parity import ParityModel

        scorer = ParityModel(policy)

    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sender = WeightSender(engine, method="tensor", bucket_bytes=args.bucket_mb << 20,
                          lora_name=getattr(engine, "lora_name", None))  # fmt: skip
    task = DigitTask(engine.tokenizer)
    log = RunLog("grpo", vars(args), args.log_dir, use_wandb=not args.no_wandb)
    token_loss = functools.partial(ppo_clip_loss, clip=args.clip)
    version = engine.get_weight_version()
    try:
        for step in log.steps(args.steps):
            prompts = task.prompts(args.prompts_per_step, step)
            params = sampling_params(args, len(prompts), step)
            outputs, rollout_s = generate_rollouts(engine, prompts, params, version)
            batch = RolloutBatch.from_outputs(prompts, outputs, args.n, task.reward)

            version = f"step-{step + 1}"
            stats = train_and_push(
                engine, sender, policy, optimizer, batch, token_loss, args, version, scorer=scorer
            )
            log.log(step + 1, {"rollout_tokens_per_s": batch.num_tokens / rollout_s, **stats})
    finally:
        sender.close()
    return log.finish(weight_version=version)


def train_and_push(
    engine: Any, sender: Any, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
    batch: RolloutBatch, token_loss: Any, args: argparse.Namespace, version: str,
    model: torch.nn.Module | None = None, scorer: torch.nn.Module | None = None,
) -> dict:  # fmt: skip
    """The training half of a step: the engine gives its memory back, the trainer measures the
    logprob gap on the batch and optimizes `model` (default: the scorer, else the policy) on it,
    then the policy's weights go to the engine as `version`. `scorer` (default: the policy)
    computes the trainer's logprobs: the parity model with --parity. Returns the step's
    statistics."""
    engine.release_memory_occupation()  # the training phase has the device to itself
    gap = logprob_gap(scorer or policy, batch, args.micro_batch, args.trainer_device)
    stats = optimize(model or scorer or policy, optimizer, batch, token_loss, args)
    sync_s = push_weights(engine, sender, policy, version)
    reward = batch.rewards.mean().item()
    return {"reward": reward, **gap, "weight_sync_s": sync_s, **stats}


if __name__ == "__main__":
    main()
