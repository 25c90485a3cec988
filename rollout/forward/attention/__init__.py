"""Attention backends by name: what each needs to run, and how to build one.

A backend is registered with what it needs to run: a package beyond torch, a GPU, the dtypes
and head sizes its kernels exist for, and whether its decode can be captured in a CUDA graph. Which backend
runs where ("auto", decode on another backend than extend) is decided by
rollout.forward.kernel_plan from these entries.
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
    head_dims: tuple[int, ...] | None = None  # None: any head size
    cuda_graph: bool = False  # the backend's supports_cuda_graph
    extend_graph: bool = False  # the backend's supports_extend_graph


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


def _deterministic(shape: AttentionShape) -> AttentionBackend:
    from rollout.forward.attention.deterministic_backend import DeterministicAttentionBackend

    return DeterministicAttentionBackend(shape)


BACKENDS: dict[str, BackendEntry] = {
    "torch": BackendEntry(_torch),
    # FlashInfer's prefill kernels (also its decode, which runs on them) exist for these head
    # sizes; others fail inside the kernel's dispatch at the first batch that reaches them.
    "flashinfer": BackendEntry(
        _flashinfer, package="flashinfer", gpu_only=True, dtypes=HALF_DTYPES,
        head_dims=(64, 128, 256), cuda_graph=True, extend_graph=True,
    ),
    "triton": BackendEntry(_triton, package="triton", gpu_only=True, cuda_graph=True),
    # Chosen by enable_deterministic_inference, and for large decode batches by
    # large_decode_piece_keys 0; on the CPU under TRITON_INTERPRET=1.
    "deterministic": BackendEntry(_deterministic, package="triton", cuda_graph=True),
}
# The backends of DecodeChoice.large_min_batch's decode batches: the Triton decode kernel with
# long pieces, or with large_piece_keys 0 the unsplit kernel.
LARGE_PIECES, UNSPLIT = "triton", "deterministic"


def large_decode_backend(piece_keys: int) -> str:
    """The backend of large decode batches cut into pieces of `piece_keys` keys (0: uncut)."""
    return LARGE_PIECES if piece_keys else UNSPLIT


@dataclass(frozen=True)
class DecodeChoice:
    """The backend decode steps run on, and the largest decode batch it takes (None: every
    batch); larger ones run on the attention backend, or from `large_min_batch` rows on (0:
    never) on a Triton kernel: the decode kernel cutting each request's keys into pieces of
    `large_piece_keys` (a shorter request is one program for each KV head), or with
    large_piece_keys 0 the unsplit kernel (the deterministic backend's, one program over all of
    a request's keys for each KV head)."""

    backend: str
    max_batch: int | None = None
    large_min_batch: int = 0
    large_piece_keys: int = 0

    @property
    def large_backend(self) -> str | None:
        return large_decode_backend(self.large_piece_keys) if self.large_min_batch else None

    def __str__(self) -> str:
        text = (
            self.backend
            if self.max_batch is None
            else f"{self.backend} up to batch {self.max_batch}"
        )
        if self.large_backend == LARGE_PIECES:
            text += f", triton in pieces of {self.large_piece_keys} keys"
        if self.large_backend == UNSPLIT:
            text += ", unsplit"
        if self.large_backend is not None:
            text += f" from batch {self.large_min_batch}"
        return text


@functools.cache
def package_imports(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # a broken install (missing CUDA libs, ABI mismatch) counts as absent
        return False
    return True


def unavailable_reason(
    name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None = None
) -> str | None:
    """Why backend `name` cannot run on `device` in `dtype` for heads of `head_dim` (None: not
    asked), or None when it can."""
    entry = BACKENDS[name]
    if entry.gpu_only and device.type != "cuda":
        return f"it needs a CUDA device, got {device}"
    if entry.dtypes is not None and dtype not in entry.dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in entry.dtypes)
        return f"it runs {names}, got {str(dtype).removeprefix('torch.')}"
    if head_dim is not None and entry.head_dims is not None and head_dim not in entry.head_dims:
        sizes = ", ".join(map(str, entry.head_dims))
        return f"its kernels take head_dim {sizes}, the model's is {head_dim}"
    if entry.package is not None and not package_imports(entry.package):
        return f"the {entry.package} package does not import"
    return None


def supports_cuda_graph(name: str, decode: DecodeChoice) -> bool:
    """Whether backend `name` with decode steps on `decode` can run inside CUDA graphs (as
    HybridAttentionBackend.supports_cuda_graph answers for the built backend)."""
    large = decode.large_backend
    large_ok = large is None or BACKENDS[large].cuda_graph
    if decode.backend == name:
        return BACKENDS[name].cuda_graph and large_ok
    extend_ok = decode.max_batch is None or BACKENDS[name].cuda_graph
    return BACKENDS[decode.backend].cuda_graph and extend_ok and large_ok


def supports_extend_graph(name: str) -> bool:
    """Whether backend `name`'s extend (it runs every extend) can run inside CUDA graphs."""
    return BACKENDS[name].extend_graph


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
    if decode.backend == name and not decode.large_min_batch:
        return BACKENDS[name].create(shape)
    from rollout.forward.attention.hybrid_backend import HybridAttentionBackend

    extend = BACKENDS[name].create(shape)
    small = extend if decode.backend == name else BACKENDS[decode.backend].create(shape)
    return HybridAttentionBackend(
        extend, small, decode.max_batch, _large_decode(decode, shape), decode.large_min_batch
    )


def _large_decode(decode: DecodeChoice, shape: AttentionShape) -> AttentionBackend | None:
    if decode.large_backend == LARGE_PIECES:
        from rollout.forward.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(shape, decode_piece_keys=decode.large_piece_keys)
    return None if decode.large_backend is None else BACKENDS[decode.large_backend].create(shape)


__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionShape",
    "DecodeChoice",
    "create_attention_backend",
    "supports_cuda_graph",
    "supports_extend_graph",
]
