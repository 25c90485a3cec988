"""GRPO with the engine in another process: `rollout serve`, reached through RolloutClient.

The trainer starts `rollout serve` on a free port (or uses --url of a running one), makes a
weight update group with it (the trainer is rank 0; gloo on CPU, NCCL between GPUs) and, each
step:
  1. rollouts over HTTP, n samples per prompt with their logprobs;
  2. the toy_task.py reward and group-normalized advantages;
  3. grpo.py's PPO-clip update, the importance ratio against the server's logprobs;
  4. pause_generation -> update_weights_from_distributed (broadcast from here) ->
     continue_generation: the update applies as one transaction when generation continues.

Before the first step the trainer's weights are pushed once, so that the server serves exactly
the policy being trained even when it was started with something else.

    python trainers_examples/remote_trainer.py                       # CPU, tiny model, gloo
    python trainers_examples/remote_trainer.py --model-path /path/to/Qwen3-0.6B \\
        --device cuda:0 --trainer-device cuda:1 --dtype bfloat16 --lr 1e-6   # NCCL across 2 GPUs

Ends by printing one JSON line (steps, first_reward, final_reward, mean_logprob_gap, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from typing import Any

import torch
from example_setup import (
    add_arguments,
    checkpoint,
    engine_options,
    load_policy,
    resolve_devices,
    sampling_params,
)
from grpo import DEFAULTS, ppo_clip_loss
from rollout_batch import RolloutBatch, generate_rollouts, logprob_gap, optimize
from run_log import RunLog
from server_process import free_port, serve
from toy_task import DigitTask


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser, DEFAULTS)
    r = parser.add_argument_group("remote engine")
    r.add_argument(
        "--url", help="a running rollout server; default: start one with the --device/--dtype flags"
    )
    r.add_argument(
        "--api-key", help="the server's admin key, when it has one (weight updates are admin calls)"
    )
    r.add_argument(
        "--backend", choices=["auto", "gloo", "nccl"], default="auto",
        help="update group backend; auto: nccl when the trainer and server are on different GPUs",
    )  # fmt: skip
    r.add_argument(
        "--master-address",
        default="127.0.0.1",
        help="this trainer's address, as the server reaches it",
    )
    r.add_argument("--master-port", type=int, help="the update group's port (default: a free one)")
    r.add_argument(
        "--per-tensor",
        action="store_true",
        help="one broadcast per tensor instead of one per dtype",
    )
    r.add_argument(
        "--server-timeout", type=float, default=300.0, help="seconds to wait for a started server"
    )
    args = parser.parse_args(argv)
    resolve_devices(args)
    if args.url and not args.model_path:
        parser.error(
            "--url needs --model-path: the trainer loads the same checkpoint the server serves"
        )
    if args.backend == "auto":
        trainer, engine = torch.device(args.trainer_device), torch.device(args.device)
        on_gpus = trainer.type == engine.type == "cuda"
        # NCCL cannot join two ranks on one GPU; with --url the server's GPU is the user's call.
        args.backend = (
            "nccl" if on_gpus and (args.url or _index(trainer) != _index(engine)) else "gloo"
        )
    return args


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def push(
    client: Any, sender: Any, policy: torch.nn.Module, version: str, load_format: str | None
) -> float:
    """Pauses generation, broadcasts the weights, continues; returns the seconds it all took.
    retract: a request in flight (another client's) re-prefills under the new weights rather
    than finishing on a mix of old and new."""
    start = time.perf_counter()
    client.pause_generation(mode="retract")
    try:
        sender.push(policy, weight_version=version, load_format=load_format)
    finally:
        client.continue_generation()  # applies the staged update, or keeps the old weights
    if client.get_weight_version() != version:
        raise RuntimeError(f"the server did not take weights {version!r}")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    from transformers import AutoTokenizer

    from rollout.client import RolloutClient
    from rollout.weight_sync.sender import WeightSender

    with contextlib.ExitStack() as stack:
        model_path = stack.enter_context(checkpoint(args))
        url = args.url or stack.enter_context(
            serve(model_path, engine_options(args), args.api_key, args.server_timeout)
        )
        client = stack.enter_context(RolloutClient(url, api_key=args.api_key))
        policy = load_policy(model_path, args.trainer_device, args.trainer_dtype)
        optimizer = torch.optim.AdamW(
            policy.parameters(), lr=args.lr, weight_decay=args.weight_decay
        )
        sender = WeightSender(client, method="distributed")
        stack.callback(sender.close)
        port = args.master_port or free_port(args.master_address)
        device = args.trainer_device if args.backend == "nccl" else None
        sender.init_group(
            args.master_address,
            port,
            backend=args.backend,
            group_name="grpo-trainer",
            device=device,
        )
        load_format = None if args.per_tensor else "flattened_bucket"
        task = DigitTask(AutoTokenizer.from_pretrained(model_path))
        log = RunLog("remote_trainer", vars(args), args.log_dir, use_wandb=not args.no_wandb)
        # grpo.py's PPO-clip, the ratio against the logprobs the server returned.
        token_loss = functools.partial(ppo_clip_loss, clip=args.clip)
        version = "step-0"
        initial_sync_s = push(client, sender, policy, version, load_format)
        for step in log.steps(args.steps):
            prompts = task.prompts(args.prompts_per_step, step)
            params = sampling_params(args, len(prompts), step)
            outputs, rollout_s = generate_rollouts(client, prompts, params, version)
            batch = RolloutBatch.from_outputs(prompts, outputs, args.n, task.reward)
            gap = logprob_gap(policy, batch, args.micro_batch, args.trainer_device)
            stats = optimize(policy, optimizer, batch, token_loss, args)
            version = f"step-{step + 1}"
            log.log(step + 1, {
                "reward": batch.rewards.mean().item(),
                **gap,
                "weight_sync_s": push(client, sender, policy, version, load_format),
                "rollout_tokens_per_s": batch.num_tokens / rollout_s,
                **stats,
            })  # fmt: skip
        return log.finish(
            weight_version=version, backend=args.backend, initial_sync_s=initial_sync_s
        )


if __name__ == "__main__":
    main()
