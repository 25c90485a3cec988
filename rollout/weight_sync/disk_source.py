"""Reading an update from a Hugging Face checkpoint directory, checked before any byte is loaded.

The checkpoint must be the same network as the one serving (every config field that shapes
the computation equal) and hold every weight, with the model's shapes; dtypes may differ (the
load casts, as at startup). Headers are checked first, then every tensor is read into host
memory, so a bad or truncated file fails before the model changes.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from rollout.models.loader import safetensors_files
from rollout.weight_sync.specs import WeightSpec

LOAD_FORMATS = (None, "auto", "safetensors")

# Config fields that decide what the weights mean; a checkpoint that differs in any of them
# is a different network, whatever its tensor shapes.
COMPATIBLE_FIELDS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
)

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def check_load_format(load_format: Any) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format for a disk update must be None, auto or safetensors, got {load_format!r}")


def check_config(model_path: str, serving: Any) -> None:
    """Raises ValueError unless `model_path`'s config.json describes the `serving` network."""
    from transformers import AutoConfig

    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model_path must be a checkpoint directory with config.json, got {model_path!r}")
    try:
        new = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the config of {model_path!r}: {e}") from e
    diffs = []
    for key in COMPATIBLE_FIELDS:
        old_value, new_value = getattr(serving, key, None), getattr(new, key, None)
        if _normalized(old_value) != _normalized(new_value):
            diffs.append(f"{key}: serving {old_value!r}, checkpoint {new_value!r}")
    if diffs:
        raise ValueError(
            f"checkpoint {model_path!r} is a different network from the one serving "
            f"({'; '.join(diffs[:4])}); restart the engine to change models"
        )


def _normalized(value: Any) -> Any:
    # transformers versions fill rope dicts differently; compare them as plain dicts.
    return dict(value) if isinstance(value, dict) else value


def read_specs(model_path: str) -> dict[str, tuple[str, WeightSpec]]:
    """name -> (file, spec) from the safetensors headers alone."""
    try:
        files = safetensors_files(model_path)
    except (FileNotFoundError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"no readable safetensors weights in {model_path!r}: {e}") from e
    out: dict[str, tuple[str, WeightSpec]] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    dtype = _ST_DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        raise ValueError(f"{name} in {path} has unsupported dtype {piece.get_dtype()}")
                    if name in out:
                        raise ValueError(f"{name} appears in both {out[name][0]} and {path}")
                    out[name] = (path, WeightSpec(name, tuple(piece.get_shape()), dtype))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read {path}: {e}") from e
    return out


def read_tensors(specs: dict[str, tuple[str, WeightSpec]], names: list[str]) -> list[tuple[str, torch.Tensor]]:
    """Reads `names` into host memory, file by file; ValueError if any is unreadable or differs
    from its header."""
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(specs[name][0], []).append(name)
    out = []
    for path, file_names in by_file.items():
        try:
            with safe_open(path, framework="pt") as f:
                for name in file_names:
                    tensor = f.get_tensor(name)
                    spec = specs[name][1]
                    if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                        raise ValueError(f"{name} in {path} does not match its header")
                    out.append((name, tensor))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"cannot read {path}: {e}") from e
    return out
