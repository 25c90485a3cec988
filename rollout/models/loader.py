"""Loading a Hugging Face checkpoint directory: config.json + safetensors (sharded or not)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from rollout.models import get_model_class

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(option: str, hf_config: Any) -> torch.dtype:
    """"auto" takes the checkpoint's dtype (float32 when it names none)."""
    if option != "auto":
        return _DTYPES[option]
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return _DTYPES.get(str(dtype).removeprefix("torch."), torch.float32)


def safetensors_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    return files


def iter_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (HF name, tensor) of the checkpoint, one shard at a time."""
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_path: str, hf_config: Any, dtype: torch.dtype, device: torch.device, load_format: str = "auto"):
    """Builds the model on `device` in `dtype` and loads its weights (random ones for "dummy")."""
    cls = get_model_class(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        _randomize(model)
    else:
        expected = set(model.hf_param_shapes())
        loaded = model.load_weights(iter_safetensors(model_path))
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint {model_path} lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
    return model.eval()


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
