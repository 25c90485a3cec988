"""Attention backends by name, and the choice behind attention_backend="auto".

A backend is registered with what it needs to run: a package beyond torch, a GPU, and the
dtypes its kernels exist for. "auto" takes the first of AUTO_ORDER that can run here, else torch.
Decode may run on another backend than extend (decode_attention_backend): "auto" there takes
triton under flashinfer (DECODE_AUTO) for decode batches of up to a given size, and the
attention backend itself for the rest.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollout.forward.attention.base import Attention, AttentionBackend, AttentionShape

HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class BackendEntry:
    create: Callable[[AttentionShape | None], AttentionBackend]
    package: str | None = None  # imported to tell whether the backend can run
    gpu_only: bool = False
    dtypes: tuple[torch.dtype, ...] | None = None  # None: any dtype


def _torch(shape: AttentionShape | None) -> AttentionBackend:
    from rollout.forward.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _flashinfer(shape: AttentionShape | None) -> AttentionBackend:
    from rollout.forward.attention.flashinfer_backend import FlashInferAttentionBackend

    if shape is None:
        raise ValueError(
            "the flashinfer backend plans by the model's shape: pass an AttentionShape"
        )
    return FlashInferAttentionBackend(shape)


def _triton(shape: AttentionShape) -> AttentionBackend:
    from rollout.forward.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(shape)


BACKENDS: dict[str, BackendEntry] = {
    "torch": BackendEntry(_torch),
    "flashinfer": BackendEntry(
        _flashinfer, package="flashinfer", gpu_only=True, dtypes=HALF_DTYPES
    ),
    "triton": BackendEntry(_triton, package="triton", gpu_only=True),
}
AUTO_ORDER = ("flashinfer", "triton")
# Decode's "auto" by the attention backend, for small decode batches (the triton_decode_max_batch
# option says how small).
DECODE_AUTO = {"flashinfer": "triton"}


@dataclass(frozen=True)
class DecodeChoice:
    """The backend decode steps run on, and the largest decode batch it takes (None: every
    batch); larger ones run on the attention backend."""

    backend: str
    max_batch: int | None = None

    def __str__(self) -> str:
        if self.max_batch is None:
            return self.backend
        return f"{self.backend} up to batch {self.max_batch}"


@functools.cache
def package_imports(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # a broken install (missing CUDA libs, ABI mismatch) counts as absent
        return False
    return True


def unavailable_reason(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why backend `name` cannot run on `device` in `dtype`, or None when it can."""
    entry = BACKENDS[name]
    if entry.gpu_only and device.type != "cuda":
        return f"it needs a CUDA device, got {device}"
    if entry.dtypes is not None and dtype not in entry.dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in entry.dtypes)
        return f"it runs {names}, got {str(dtype).removeprefix('torch.')}"
    if entry.package is not None and not package_imports(entry.package):
        return f"the {entry.package} package does not import"
    return None


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend to build for option value `name`; raises ValueError, naming why, when an
    explicitly named backend cannot run here."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            if candidate in BACKENDS and unavailable_reason(candidate, device, dtype) is None:
                return candidate
        return "torch"
    return _named_backend("attention_backend", name, device, dtype, "; use auto or torch")


def _named_backend(
    option: str, name: str, device: torch.device, dtype: torch.dtype, hint: str = ""
) -> str:
    """`name` as given for `option`, once it is known and can run here; else ValueError."""
    if name not in BACKENDS:
        raise ValueError(f"{option} must be one of auto, {', '.join(BACKENDS)}, got {name!r}")
    reason = unavailable_reason(name, device, dtype)
    if reason is not None:
        raise ValueError(f"{option}={name!r} cannot run here: {reason}{hint}")
    return name


def resolve_decode_backend(
    name: str, attention_backend: str, device: torch.device, dtype: torch.dtype, auto_max_batch: int
) -> DecodeChoice:
    """Where decode runs for option value `name`, given the resolved attention backend and,
    for "auto", the largest decode batch on DECODE_AUTO's backend; raises ValueError, naming
    why, when an explicitly named backend cannot run here."""
    if name == "auto":
        preferred = DECODE_AUTO.get(attention_backend)
        runs = preferred is not None and unavailable_reason(preferred, device, dtype) is None
        if runs and auto_max_batch > 0:
            return DecodeChoice(preferred, auto_max_batch)
        return DecodeChoice(attention_backend)
    return DecodeChoice(_named_backend("decode_attention_backend", name, device, dtype))


def create_attention_backend(
    name: str, shape: AttentionShape | None = None, decode: DecodeChoice | str | None = None
) -> AttentionBackend:
    """Builds backend `name` (already resolved, not "auto") for a model of `shape`, with decode
    steps on `decode` (a backend name: all of them) where that differs; backends that size
    nothing by the model (torch) need no shape."""
    if not isinstance(decode, DecodeChoice):
        decode = DecodeChoice(decode or name)
    for backend in (name, decode.backend):
        if backend not in BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(BACKENDS)}, got {backend!r}"
            )
    if decode.backend == name:
        return BACKENDS[name].create(shape)
    from rollout.forward.attention.hybrid_backend import HybridAttentionBackend

    return HybridAttentionBackend(
        BACKENDS[name].create(shape), BACKENDS[decode.backend].create(shape), decode.max_batch
    )


__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionShape",
    "DecodeChoice",
    "create_attention_backend",
    "resolve_attention_backend",
    "resolve_decode_backend",
]
