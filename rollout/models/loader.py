"""Loading a Hugging Face checkpoint directory: config.json + safetensors (sharded or not)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from rollout.models import get_model_class

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(option: str, hf_config: Any) -> torch.dtype:
    """The dtype for `option` (auto, bfloat16, float16, float32). "auto" takes the
    checkpoint's own dtype from its config, float32 when the config names none."""
    if option != "auto":
        if option not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}, got {option!r}")
        return _DTYPES[option]
    # transformers v5 calls it `dtype`, v4 `torch_dtype`; either a torch.dtype or a string.
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return _DTYPES.get(str(dtype).removeprefix("torch."), torch.float32)


def safetensors_files(model_path: str) -> list[str]:
    """The checkpoint's weight files: the shards an index names, else model.safetensors,
    else every *.safetensors in the directory."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    single = os.path.join(model_path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    return files


def iter_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (HF name, CPU tensor) of the checkpoint, one tensor at a time (memory stays flat)."""
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The model of `hf_config`, allocated directly on `device` in `dtype` (weights undefined)."""
    cls = get_model_class(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(hf_config)
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_path: str,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
) -> nn.Module:
    """Builds the model on `device` in `dtype` and loads the checkpoint at `model_path`
    (load_format "auto"), or fills it with seeded random weights ("dummy"). Returns it in
    eval mode. Raises ValueError when the checkpoint lacks any parameter."""
    model = build_model(hf_config, dtype, device)
    if load_format == "dummy":
        _randomize(model)
    elif load_format == "auto":
        loaded = model.load_weights(iter_safetensors(model_path))
        missing = sorted(set(model.hf_param_shapes()) - loaded)
        if missing:
            raise ValueError(
                f"checkpoint {model_path} lacks {len(missing)} parameters, e.g. {missing[:3]}"
            )
    else:
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    return model.eval()


@torch.no_grad()
def _randomize(model: nn.Module) -> None:
    # Small normal weights and unit norms keep activations in range through many layers.
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
