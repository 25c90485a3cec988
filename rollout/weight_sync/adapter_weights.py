"""The trainer's side of an adapter push: a PEFT model's LoRA weights, and nothing else.

A PeftModel's parameters are the frozen base model's plus, for each adapted projection,
`...q_proj.lora_A.<adapter>.weight` and `...lora_B.<adapter>.weight`. WeightSender pushes only
those of the active adapter, named as PEFT saves them (`base_model.model.<HF module>.lora_A.
weight`), to a named adapter the engine has loaded (rollout/weight_sync/adapter_update.py).
peft itself is never imported: a model is told by its parameter names.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch
from torch import nn

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# A live PeftModel's LoRA parameter: <module>.lora_A.<adapter>.weight.
_LIVE = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>[AB])\.(?P<adapter>[\w-]+)\.weight$")


def has_lora(module: nn.Module) -> bool:
    """Does `module` carry LoRA weights (a PEFT model)?"""
    return any(_LIVE.match(name) for name, _ in module.named_parameters())


def active_adapter(module: nn.Module) -> str:
    """The PEFT adapter a model trains (PeftModel.active_adapter), "default" without one."""
    active = getattr(module, "active_adapter", "default")
    return active if isinstance(active, str) else "default"


def lora_weights(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The active adapter's lora_A / lora_B tensors (detached), PEFT's saved names. ValueError
    when the model has none."""
    adapter = active_adapter(module)
    named = []
    for name, param in module.named_parameters():
        match = _LIVE.match(name)
        if match is not None and match["adapter"] == adapter:
            named.append((f"{match['module']}.lora_{match['kind']}.weight", param.detach()))
    if not named:
        raise ValueError(
            f"{type(module).__name__} has no LoRA weights of adapter {adapter!r} (a PEFT model's "
            f"...lora_A.{adapter}.weight parameters)"
        )
    return named


def adapter_config(module: nn.Module) -> dict[str, Any]:
    """adapter_config.json of the active adapter of a PeftModel (its peft_config)."""
    configs = getattr(module, "peft_config", None)
    adapter = active_adapter(module)
    if not isinstance(configs, dict) or adapter not in configs:
        raise ValueError(
            "a disk push of an adapter needs the PeftModel itself (its peft_config is written "
            "as adapter_config.json)"
        )
    config = configs[adapter].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def write_adapter_dir(
    directory: str, config: dict[str, Any], named: list[tuple[str, torch.Tensor]]
) -> None:
    """Saves a PEFT adapter directory: adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config, f, default=str)
    tensors = {n: t.to("cpu").contiguous() for n, t in named}
    save_file(tensors, os.path.join(directory, WEIGHTS_FILE))
