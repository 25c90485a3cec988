"""Maps Hugging Face parameter names onto a model's fused parameters.

q/k/v projections live in one `qkv_proj`, gate/up in one `gate_up_proj`: each HF tensor is
a slice of a fused parameter. Every weight source (disk, tensors, broadcasts) loads through
`WeightMapper.load`, and `expected()` lets a caller check names and shapes before anything
changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

# HF projection name -> (fused module name, index of its slice)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Buffers some checkpoints carry that hold nothing to load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Target:
    param: nn.Parameter
    start: int  # rows [start, start + rows) of dim 0; the whole parameter when rows == -1
    rows: int


class WeightMapper:
    def __init__(self, model: nn.Module) -> None:
        self.targets: dict[str, Target] = {}
        for name, param in model.named_parameters():
            module_name, _, kind = name.rpartition(".")  # kind: weight | bias
            parent, _, leaf = module_name.rpartition(".")
            fused = [(hf, idx) for hf, (f, idx) in _FUSED.items() if f == leaf]
            if not fused:
                self.targets[name] = Target(param, 0, -1)
                continue
            sizes = _slice_sizes(model, module_name, leaf, param.shape[0])
            for hf, idx in fused:
                start = sum(sizes[:idx])
                self.targets[f"{parent}.{hf}.{kind}"] = Target(param, start, sizes[idx])
        # A tied checkpoint may still carry lm_head.weight: it is the embedding, skip it.
        self.tied_head = bool(getattr(model, "tie_word_embeddings", False))

    def expected(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (self._shape(name), t.param.dtype) for name, t in self.targets.items()}

    def resolve(self, name: str) -> str | None:
        """The target name for an HF name; None for names that carry nothing to load."""
        if name.endswith(_IGNORED_SUFFIXES):
            return None
        if name == "lm_head.weight" and self.tied_head:
            return None
        if name not in self.targets:
            raise KeyError(f"unknown parameter {name!r} for this model")
        return name

    def check(self, name: str, tensor: torch.Tensor) -> None:
        """Raises if `tensor` can't be loaded as HF parameter `name`."""
        target = self.resolve(name)
        if target is None:
            return
        want = self._shape(target)
        if tuple(tensor.shape) != want:
            raise ValueError(f"shape mismatch for {name!r}: expected {list(want)}, got {list(tensor.shape)}")

    def _shape(self, target: str) -> tuple[int, ...]:
        t = self.targets[target]
        return tuple(t.param.shape) if t.rows < 0 else (t.rows, *t.param.shape[1:])

    @torch.no_grad()
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            self.check(name, tensor)
            target = self.resolve(name)
            if target is None:
                continue
            t = self.targets[target]
            dest = t.param.data if t.rows < 0 else t.param.data[t.start : t.start + t.rows]
            dest.copy_(tensor.to(device=dest.device, dtype=dest.dtype))
            loaded.add(name)
        return loaded


def _slice_sizes(model: nn.Module, module_name: str, leaf: str, total: int) -> list[int]:
    attn = model.get_submodule(module_name.rpartition(".")[0])
    if leaf == "qkv_proj":
        return [attn.q_size, attn.kv_size, attn.kv_size]
    return [total // 2, total // 2]
