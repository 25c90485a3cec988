"""ForwardBatch: the tensors of one model forward, built by the ModelRunner from a ScheduleBatch."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollout.forward.attention.base import AttentionBackend
    from rollout.forward.kv_pool import KVPool


class ForwardMode(Enum):
    EXTEND = "extend"  # new tokens after an (optionally empty) cached prefix: prefill and chunks
    DECODE = "decode"  # exactly one new token per request


@dataclass
class ForwardBatch:
    """Tokens of all requests are laid out back to back ("ragged"): request i owns
    rows extend_starts[i] : extend_starts[i] + extend_lens[i] of every [T, ...] tensor."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token
    req_pool_indices: torch.Tensor  # [B] int64, row in req_to_token
    seq_lens: torch.Tensor  # [B] int64, tokens in KV after this forward
    extend_lens: torch.Tensor  # [B] int64, new tokens this forward
    req_to_token: torch.Tensor  # [max_reqs, max_context] int64
    kv_pool: KVPool
    attn_backend: AttentionBackend
    # Host copies: backends and the runner read them without a device sync.
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)
