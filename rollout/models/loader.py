"""Loading a Hugging Face checkpoint directory: config.json + safetensors (sharded or not)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from rollout.models import get_model_class

INDEX = "model.safetensors.index.json"
_FD_DIR = "/proc/self/fd"
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


class OutsideRootsError(PermissionError):
    """A checkpoint file resolves outside the allowed weight roots. The message names the file
    as the checkpoint names it, never where it points."""


def check_shard_name(entry: Any) -> str:
    """An index's shard entry must name a file inside the checkpoint: a relative path with no
    `..` component (an absolute or climbing name would read any file on the machine)."""
    if not isinstance(entry, str) or not entry or "\0" in entry:
        raise ValueError(f"{INDEX} names the shard {entry!r:.200}; a shard must be a file name")
    if os.path.isabs(entry) or entry.startswith(("/", "\\")) or ".." in re.split(r"[/\\]", entry):
        raise ValueError(
            f"{INDEX} names the shard {entry!r:.200}, outside the checkpoint: shard names must be "
            f"relative file names without '..', e.g. model-00001-of-00002.safetensors"
        )
    return entry


@contextlib.contextmanager
def open_checked(path: str, what: str, roots: Sequence[str] | None = None) -> Iterator[str]:
    """Opens the regular file `path` and yields a path naming that very open file, for readers
    that take a path (safetensors, transformers); closes it on exit. `what` names the file in
    errors. With `roots`, the file must resolve (symlinks followed) under one of them: checked
    before opening, so nothing outside is ever opened (not even a FIFO), and again on the open
    file itself, so a symlink swapped in between is caught (no check-then-open race)."""
    real_roots = None if roots is None else [os.path.realpath(r) for r in roots]
    if real_roots is not None and not _under(os.path.realpath(path), real_roots):
        raise OutsideRootsError(f"{what} resolves outside the allowed weight roots")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ValueError(f"cannot open {what}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{what} is not a regular file")
        # /proc/self/fd/N is the open file, whatever happens to `path` meanwhile. Without /proc
        # (not Linux), fall back to the name, checked again as close to the read as we can.
        opened = os.path.join(_FD_DIR, str(fd)) if os.path.isdir(_FD_DIR) else None
        real = os.readlink(opened) if opened else os.path.realpath(path)
        if real_roots is not None and not _under(real, real_roots):
            raise OutsideRootsError(f"{what} resolves outside the allowed weight roots")
        yield opened or path
    finally:
        os.close(fd)


def _under(real: str, real_roots: list[str]) -> bool:
    return any(os.path.commonpath([real, root]) == root for root in real_roots)


def safetensors_files(model_path: str, roots: Sequence[str] | None = None) -> list[str]:
    """The checkpoint's weight files: the shards an index names, else model.safetensors,
    else every *.safetensors in the directory. ValueError for an index that is unreadable or
    names a shard outside the checkpoint; FileNotFoundError when there are no weight files."""
    index = os.path.join(model_path, INDEX)
    if os.path.lexists(index):
        with open_checked(index, INDEX, roots) as readable, open(readable) as f:
            try:
                weight_map = json.load(f).get("weight_map")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                raise ValueError(f"{INDEX} is not a JSON object: {type(e).__name__}") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{INDEX} must hold a non-empty weight_map object")
        shards = sorted({check_shard_name(s) for s in weight_map.values()})
        return [os.path.join(model_path, s) for s in shards]
    single = os.path.join(model_path, "model.safetensors")
    if os.path.lexists(single):
        return [single]
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    return [os.path.join(model_path, f) for f in files]


def shard_label(path: str, model_path: str) -> str:
    """How errors name a weight file: as the checkpoint names it."""
    return f"shard {os.path.relpath(path, model_path)!r}"


def iter_safetensors(
    model_path: str, roots: Sequence[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (HF name, CPU tensor) of the checkpoint, one tensor at a time (memory stays flat).
    With `roots`, every file read must resolve under one of them (see open_checked)."""
    for path in safetensors_files(model_path, roots):
        with open_checked(path, shard_label(path, model_path), roots) as readable:
            with safe_open(readable, framework="pt") as f:
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
