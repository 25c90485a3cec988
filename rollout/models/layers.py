"""Building blocks shared by the model files: norms, rotary embedding, fused projections."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [..., D]. With a residual, returns (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


def rope_parameters(config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) across transformers versions (v5 folds both into rope_parameters)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return float(theta), params


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` dims of q and k by position (GPT-NeoX / HF layout: halves)."""

    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        theta, params = rope_parameters(config)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
            self.scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unsupported rope type {rope_type!r}")
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        # On the device the model is being built on (torch.device context), not where it was computed.
        self.inv_freq = nn.Buffer(inv_freq.float().to(torch.empty(0).device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [T]; q: [T, H, D], k: [T, Hkv, D] -> rotated (q, k)."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        cos = (freqs.cos() * self.scaling)[:, None, :]
        sin = (freqs.sin() * self.scaling)[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class SiluAndMulMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
