from __future__ import annotations

from rollout.engine.attention.base import Attention, AttentionBackend


def create_attention_backend(name: str) -> AttentionBackend:
    """Backends by name; only the torch backend exists on every device."""
    if name == "torch":
        from rollout.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"attention_backend must be one of: torch, got {name!r}")


__all__ = ["Attention", "AttentionBackend", "create_attention_backend"]
