"""Reading an update from a Hugging Face checkpoint directory, checked before any byte is loaded.

The checkpoint must be the same network as the one serving (every config field that shapes
the computation equal) and hold every weight, with the model's shapes; dtypes may differ (the
load casts, as at startup). Headers are checked first, then every tensor is read into host
memory, so a bad or truncated file fails before the model changes.

Given allowed roots (the server's --allowed-weight-roots), every file is checked where it is
opened (config.json, the index, each shard: see loader.open_checked), symlinks followed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from rollout.errors import InvalidRequest
from rollout.forward.tensor_parallel import Shard
from rollout.models.loader import open_checked, safetensors_files, shard_label
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
        raise InvalidRequest(
            f"load_format for a disk update must be None, auto or safetensors, got {load_format!r}"
        )


def check_config(model_path: str, serving: Any, roots: Sequence[str] | None = None) -> None:
    """Raises ValueError unless `model_path`'s config.json describes the `serving` network
    (OutsideRootsError if, with `roots`, it resolves outside them)."""
    from transformers import AutoConfig

    path = os.path.join(model_path, "config.json")
    if not os.path.lexists(path):
        raise InvalidRequest(
            f"model_path must be a checkpoint directory with config.json, got {model_path!r}"
        )
    with open_checked(path, "config.json", roots) as readable:
        try:
            new = AutoConfig.from_pretrained(readable)
        except (OSError, ValueError, json.JSONDecodeError) as e:
            # Name the file as the caller knows it, not by the descriptor path read here.
            reason = str(e).replace(readable, "config.json")[:300]
            raise InvalidRequest(f"cannot read the config of {model_path!r}: {reason}") from e
    diffs = []
    for key in COMPATIBLE_FIELDS:
        old_value, new_value = getattr(serving, key, None), getattr(new, key, None)
        if _normalized(old_value) != _normalized(new_value):
            diffs.append(f"{key}: serving {old_value!r}, checkpoint {new_value!r}")
    if diffs:
        raise InvalidRequest(
            f"checkpoint {model_path!r} is a different network from the one serving "
            f"({'; '.join(diffs[:4])}); restart the engine to change models"
        )


def _normalized(value: Any) -> Any:
    # transformers versions fill rope dicts differently; compare them as plain dicts.
    return dict(value) if isinstance(value, dict) else value


Found = dict[str, tuple[str, WeightSpec]]  # HF name -> (file, spec)


def read_specs(model_path: str, roots: Sequence[str] | None = None) -> Found:
    """name -> (file, spec) from the safetensors headers alone. With `roots`, every file opened
    (index, shards) must resolve under one of them, else OutsideRootsError."""
    try:
        files = safetensors_files(model_path, roots)
    except FileNotFoundError as e:
        raise InvalidRequest(f"no readable safetensors weights in {model_path!r}: {e}") from e
    out: Found = {}
    for path in files:
        label = shard_label(path, model_path)
        with open_checked(path, label, roots) as readable:
            try:
                with safe_open(readable, framework="pt") as f:
                    for name in f.keys():
                        piece = f.get_slice(name)
                        dtype = _ST_DTYPES.get(piece.get_dtype())
                        if dtype is None:
                            kind = piece.get_dtype()
                            raise InvalidRequest(f"{name} in {label} has unsupported dtype {kind}")
                        if name in out:
                            first = shard_label(out[name][0], model_path)
                            raise InvalidRequest(f"{name} appears in both {first} and {label}")
                        out[name] = (path, WeightSpec(name, tuple(piece.get_shape()), dtype))
            except (SafetensorError, OSError) as e:
                raise InvalidRequest(f"cannot read {label}: {e}") from e
    return out


def read_tensors(
    specs: Found,
    names: list[str],
    model_path: str,
    roots: Sequence[str] | None = None,
    shard_of: Callable[[str], Shard | None] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Reads `names` into host memory, file by file; ValueError if any is unreadable or differs
    from its header. Each file is opened (and, with `roots`, checked) again here. With
    `shard_of` (a tensor-parallel rank's `hf_shard`), a tensor it gives a Shard for is read as
    that slice only (its header must hold the full shape: check the specs first)."""
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(specs[name][0], []).append(name)
    out = []
    for path, file_names in by_file.items():
        label = shard_label(path, model_path)
        with open_checked(path, label, roots) as readable:
            try:
                with safe_open(readable, framework="pt") as f:
                    for name in file_names:
                        spec = specs[name][1]
                        shard = None if shard_of is None else shard_of(name)
                        if shard is None:
                            tensor, shape = f.get_tensor(name), spec.shape
                        else:
                            tensor = f.get_slice(name)[shard.index()]
                            shape = tuple(shard.size if d == shard.dim else n
                                          for d, n in enumerate(spec.shape))  # fmt: skip
                        if tuple(tensor.shape) != shape or tensor.dtype != spec.dtype:
                            raise InvalidRequest(f"{name} in {label} does not match its header")
                        out.append((name, tensor))
            except (SafetensorError, OSError, RuntimeError) as e:
                raise InvalidRequest(f"cannot read {label}: {e}") from e
    return out
