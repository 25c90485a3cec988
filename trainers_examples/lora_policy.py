"""grpo.py --lora-rank R: a LoRA policy trained with PEFT, the engine serving its adapter.

The trainer wraps its model in PEFT's LoRA (rank R on every linear projection, B = 0: the
adapter starts as a no-op) and saves that adapter; the engine starts with enable_lora and the
adapter loaded as "policy", and every rollout request names it (lora_path). Each step the
WeightSender pushes the adapter only (its lora_A / lora_B tensors, a fraction of a percent of
the model at real sizes) to that adapter, and the outputs carry the adapter's version.

    python trainers_examples/grpo.py --lora-rank 8
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

LORA_NAME = "policy"
LORA_LR = 2e-2  # LoRA's few parameters take a larger step than full fine-tuning's


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA")
    g.add_argument(
        "--lora-rank", type=int, default=0,
        help="train a LoRA adapter of this rank (PEFT) and push only it (0: full fine-tuning); "
        f"--lr then defaults to {LORA_LR}",
    )  # fmt: skip
    g.add_argument("--lora-alpha", type=float, help="LoRA alpha (default: 2 x rank)")


def check_lora_arguments(args: argparse.Namespace, lr_default: float) -> None:
    """Validates the LoRA flags; with --lora-rank and no --lr given, LoRA's learning rate."""
    if args.lora_rank < 0:
        raise SystemExit(f"--lora-rank must be >= 0, got {args.lora_rank}")
    if args.lora_rank and getattr(args, "replicas", 0):
        raise SystemExit("--lora-rank serves the adapter from one engine: drop --replicas")
    if args.lora_rank and args.lr == lr_default:
        args.lr = LORA_LR
    if args.lora_alpha is None:
        args.lora_alpha = 2.0 * args.lora_rank


def wrap_policy(policy: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """`policy` with a trainable LoRA adapter on every linear projection (the base frozen)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SystemExit("--lora-rank needs peft: pip install peft") from None
    config = LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
        target_modules="all-linear",
    )  # fmt: skip
    return get_peft_model(policy, config).eval()


class AdapterEngine:
    """The engine as grpo.py uses it, every generation on adapter `name`; the weight version
    it reports is the adapter's (what the rollouts' meta_info.weight_version says)."""

    def __init__(self, engine: Any, name: str) -> None:
        self._engine, self.lora_name = engine, name

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine.generate(*args, lora_path=self.lora_name, **kwargs)

    def get_weight_version(self) -> str:
        return self._engine.get_server_info()["lora_weight_versions"][self.lora_name]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@contextlib.contextmanager
def adapter_engine(
    model_path: str, policy: torch.nn.Module, options: dict[str, Any], rank: int
) -> Iterator[AdapterEngine]:
    """A RolloutEngine serving the base model with `policy`'s (PEFT) adapter loaded as
    LORA_NAME; the adapter's initial files live in a temporary directory while it starts."""
    from rollout import RolloutEngine

    with tempfile.TemporaryDirectory(prefix="rollout-lora-") as tmp:
        policy.save_pretrained(tmp)
        lora = {
            "lora_paths": [f"{LORA_NAME}={tmp}"],
            "max_lora_rank": rank,
            "max_loras_per_batch": 1,
        }
        engine = RolloutEngine(model_path, **options, **lora)
    with engine:
        yield AdapterEngine(engine, LORA_NAME)
