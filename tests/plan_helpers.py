"""The kernel plan an engine of some options would run, on a device that need not be here, and
batches that hold only lengths, for routing them."""

from __future__ import annotations

import torch

from rollout.config import EngineOptions
from rollout.forward.attention import DecodeChoice
from rollout.forward.forward_batch import ForwardBatch, ForwardMode
from rollout.forward.kernel_plan import KernelPlan, resolve_kernel_plan

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def plan_for(device: torch.device, dtype: torch.dtype, **options) -> KernelPlan:
    """The plan of an engine with these flat options on `device` in `dtype`."""
    return resolve_kernel_plan(EngineOptions.from_kwargs(model_path="m", **options), device, dtype)


def decode(
    extend: str, device: torch.device, dtype: torch.dtype, name: str, cut: int
) -> DecodeChoice:
    options = {"decode_attention_backend": name, "triton_decode_max_batch": cut}
    return plan_for(device, dtype, attention_backend=extend, **options).decode_attention


def lengths_batch(mode: ForwardMode, lens: list[int]) -> ForwardBatch:
    """A batch of requests with `lens` new tokens and keys each, and no tensors beyond them."""
    n = torch.tensor(lens)
    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(int(n.sum()), dtype=torch.int64), positions=None,
        out_cache_loc=None, req_pool_indices=torch.arange(len(lens)), seq_lens=n, extend_lens=n,
        req_to_token=None, kv_pool=None, attn_backend=None, seq_lens_cpu=lens, extend_lens_cpu=lens,
    )  # fmt: skip
