"""What the examples share: flags, the checkpoint, the trainer's model, sampling parameters,
and the colocated engine's weight push.

Without --model-path a tiny random checkpoint is written to a temporary directory (removed at
the end), so every example runs anywhere in a few minutes; with it, the same loop trains a
real model (give --device cuda --dtype bfloat16 and larger --max-new-tokens on a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch


def add_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """The flags every example takes; `defaults` are the example's own tuned values."""
    m = parser.add_argument_group("model and devices")
    m.add_argument(
        "--model-path", help="HF checkpoint directory; default: a tiny random model made on the fly"
    )
    m.add_argument(
        "--arch",
        default="qwen3",
        choices=["llama", "qwen2", "qwen3"],
        help="arch of the tiny model",
    )
    m.add_argument(
        "--device", help="the engine's device, cpu or cuda[:i] (default: cuda when available)"
    )
    m.add_argument(
        "--dtype", default="float32", help="the engine's dtype: float32, bfloat16, float16"
    )
    m.add_argument("--trainer-device", help="the trainer's device (default: the engine's)")
    m.add_argument("--trainer-dtype", default="float32", help="the trainer's parameter dtype")
    m.add_argument(
        "--engine-option", action="append", default=[], metavar="NAME=VALUE",
        help="any other engine option, e.g. mem_fraction=0.5 (repeatable; values parsed as JSON "
        "when they can be)",
    )  # fmt: skip

    t = parser.add_argument_group("GRPO")
    t.add_argument("--steps", type=int, default=defaults["steps"], help="training steps")
    t.add_argument(
        "--prompts-per-step",
        type=int,
        default=defaults["prompts_per_step"],
        help="prompts per step",
    )
    t.add_argument(
        "--n", type=int, default=defaults["n"], help="samples per prompt (the GRPO group)"
    )
    t.add_argument(
        "--max-new-tokens", type=int, default=defaults["max_new_tokens"], help="tokens per sample"
    )
    t.add_argument("--lr", type=float, default=defaults["lr"], help="AdamW learning rate")
    t.add_argument(
        "--weight-decay", type=float, default=0.0,
        help="AdamW's decoupled weight decay: every step shrinks each weight by lr × this",
    )  # fmt: skip
    t.add_argument("--clip", type=float, default=0.2, help="PPO clip range of the importance ratio")
    t.add_argument(
        "--tis-cap", type=float, default=None,
        help="truncated importance sampling: take the ratio against the trainer's logprobs of "
        "the rollout weights and weight each token by min(exp(trainer - engine logprob), CAP) "
        "(verl/slime's correction of the engine/trainer mismatch); default off",
    )  # fmt: skip
    t.add_argument(
        "--minibatches",
        type=int,
        default=defaults["minibatches"],
        help="optimizer steps per training step",
    )
    t.add_argument(
        "--micro-batch", type=int, default=16, help="samples per forward (gradient accumulation)"
    )
    t.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping")
    t.add_argument(
        "--seed", type=int, default=0, help="seeds the tiny model, the trainer and sampling"
    )

    g = parser.add_argument_group("logging")
    g.add_argument(
        "--log-dir",
        help="where the wandb run (offline unless WANDB_MODE says otherwise) and the PNG of the "
        "curves go; default: ./runs/EXAMPLE-YYYYmmdd-HHMMSS",
    )
    g.add_argument(
        "--no-wandb", action="store_true", help="do not log to wandb even when it is installed"
    )


def resolve_devices(args: argparse.Namespace) -> None:
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.trainer_device is None:
        args.trainer_device = args.device
    for name in ("steps", "prompts_per_step", "n", "max_new_tokens", "minibatches", "micro_batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.model_path and args.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        one_thread_per_process()


def one_thread_per_process() -> None:
    """One torch thread here and in every process started from here on (the engine's scheduler
    and detokenizer, a server and its own): the tiny model's ops are too small to split, and
    with more threads than cores, split ops wait on threads the OS has descheduled. On a busy
    2-core machine that made a run 8x slower (ppo.py: 5 minutes instead of 40 s)."""
    os.environ["OMP_NUM_THREADS"] = "1"  # read by each child's torch as it starts
    torch.set_num_threads(1)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """device, dtype and seed, plus every --engine-option NAME=VALUE."""
    options = {"device": args.device, "dtype": args.dtype, "random_seed": args.seed}
    return {**options, **parse_options(args.engine_option, "--engine-option")}


def parse_options(items: list[str], flag: str) -> dict[str, Any]:
    """NAME=VALUE strings -> {name: value}, values parsed as JSON when they can be."""
    options: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"{flag} must look like NAME=VALUE, got {item!r}")
        try:
            options[name.replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            options[name.replace("-", "_")] = raw
    return options


@contextlib.contextmanager
def checkpoint(args: argparse.Namespace) -> Iterator[str]:
    """args.model_path, or a tiny random checkpoint in a temporary directory."""
    if args.model_path:
        yield args.model_path
        return
    from rollout.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="rollout-example-") as tmp:
        yield make_tiny_model(tmp, arch=args.arch, seed=args.seed)


def load_policy(model_path: str, device: str, dtype: str) -> torch.nn.Module:
    """The trainer's copy of the policy: a plain transformers model. In eval mode (gradients
    flow all the same): dropout would make the trainer's logprobs differ from the policy the
    engine samples, which the importance ratio assumes they don't."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def sampling_params(args: argparse.Namespace, num_prompts: int, step: int) -> list[dict[str, Any]]:
    """One entry per prompt, each with its own seed (sample i of a prompt uses seed + i).
    Temperature 1 and no top-p/top-k: the engine's logprobs (raw log-softmax) are then exactly
    the logprobs of the distribution the tokens were drawn from, as the importance ratio needs."""
    base = (args.seed * 1_000_003 + step * num_prompts) * args.n
    return [
        {
            "n": args.n,
            "temperature": 1.0,
            "max_new_tokens": args.max_new_tokens,
            "seed": base + p * args.n,
        }
        for p in range(num_prompts)
    ]


def push_weights(engine: Any, sender: Any, policy: torch.nn.Module, version: str) -> float:
    """Brings back a colocated engine whose memory was released for training, with the
    policy's weights as `version`; returns the seconds the push took. Weights first, so that
    the push has their memory; the KV cache and CUDA graphs after it."""
    engine.resume_memory_occupation(["weights"])
    start = time.perf_counter()
    sender.push(policy, weight_version=version)
    seconds = time.perf_counter() - start
    engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
    return seconds
