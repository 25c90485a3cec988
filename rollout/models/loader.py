"""Loading a Hugging Face checkpoint directory: config.json + safetensors (sharded or not)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from rollout.forward.tensor_parallel import SINGLE, Shard, TPGroup
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
    model_path: str,
    roots: Sequence[str] | None = None,
    shard_of: Callable[[str], Shard | None] | None = None,
    skip: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (HF name, CPU tensor) of the checkpoint, one tensor at a time (memory stays flat).
    With `roots`, every file read must resolve under one of them (see open_checked). With
    `shard_of` (a model's `hf_shard`), a tensor it gives a Shard for is read as that slice
    only, the rest never leaving the file; ValueError when the tensor on disk is not as long
    along the shard's dim as the model's full tensor. Names `skip` is true for are not read."""
    for path in safetensors_files(model_path, roots):
        with open_checked(path, shard_label(path, model_path), roots) as readable:
            with safe_open(readable, framework="pt") as f:
                for name in f.keys():
                    if skip is not None and skip(name):
                        continue
                    shard = None if shard_of is None else shard_of(name)
                    if shard is None:
                        yield name, f.get_tensor(name)
                        continue
                    lazy = f.get_slice(name)
                    shape = list(lazy.get_shape())
                    if len(shape) <= shard.dim or shape[shard.dim] != shard.full:
                        raise ValueError(
                            f"shape mismatch for {name!r}: expected {shard.full} along dim "
                            f"{shard.dim}, got {shape}"
                        )
                    yield name, lazy[shard.index()]


def build_model(
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPGroup = SINGLE,
) -> nn.Module:
    """Tensor-parallel rank `tp.rank`'s part of the model of `hf_config` (all of it at tp=1),
    allocated directly on `device` in `dtype` (weights undefined)."""
    cls = get_model_class(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(hf_config, tp=tp)
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_path: str,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    tp: TPGroup = SINGLE,
) -> nn.Module:
    """Builds tensor-parallel rank `tp.rank`'s part of the model on `device` in `dtype` and
    loads its slice of the checkpoint at `model_path` (load_format "auto"; only that slice is
    read), or fills it with seeded random weights ("dummy": each rank's slice of the same
    random model, whatever the tp size). Returns it in eval mode. Raises ValueError when the
    checkpoint lacks any parameter."""
    model = build_model(hf_config, dtype, device, tp)
    if load_format == "dummy":
        _randomize(model)
    elif load_format == "auto":
        tensors = iter_safetensors(
            model_path, shard_of=model.hf_shard, skip=model.is_ignored_weight
        )
        loaded = model.load_weights(tensors, presharded=True)
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
    """Every checkpoint tensor drawn whole from a seed of its own name, then sliced: any tp
    size holds parts of the same model. Small normal weights and unit norms keep activations in
    range through many layers."""
    device = next(model.parameters()).device
    for name, (shape, dtype) in model.hf_param_shapes().items():
        if name.endswith("norm.weight"):
            full = torch.ones(shape, dtype=dtype, device=device)
        else:
            gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
            full = torch.empty(shape, dtype=dtype, device=device)
            full.normal_(0.0, 0.02, generator=gen)
        model.load_weights([(name, full)])
