"""The engine's LoRA options (SGLang's names): which adapters it serves and how many at once.
Part of EngineOptions (rollout/config.py) as its `lora` part."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.option_field import option as _opt


@dataclass(frozen=True)
class LoraOptions:
    """LoRA adapters served beside the base model (SGLang's option names)."""

    enable_lora: bool = _opt(
        False, "serve LoRA adapters: requests pick one by name (lora_path), or the base model"
    )
    max_loras_per_batch: int = _opt(8, "adapter slots: adapters loaded at once, any mix per batch")
    max_lora_rank: int | None = _opt(
        None, "largest adapter rank the slots hold; default: the largest of lora_paths', else 64"
    )
    lora_target_modules: tuple[str, ...] | None = _opt(
        None,
        "projections adapters may change: q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj, or all (repeatable); default: those of lora_paths, else all",
    )
    lora_paths: tuple[str, ...] | None = _opt(
        None, "adapters to load at start, NAME=PATH or PATH (named by its path); repeatable"
    )

    def __post_init__(self) -> None:
        if self.lora_paths is not None:
            object.__setattr__(self, "lora_paths", tuple(self.lora_paths))
            object.__setattr__(self, "enable_lora", True)
        if self.lora_target_modules is not None:
            modules = self.lora_target_modules
            modules = (modules,) if isinstance(modules, str) else tuple(modules)
            object.__setattr__(self, "lora_target_modules", modules)
        if not isinstance(self.max_loras_per_batch, int) or self.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be an int >= 1, got {self.max_loras_per_batch!r}")
        rank = self.max_lora_rank
        if rank is not None and (not isinstance(rank, int) or rank < 1):
            raise ValueError(f"max_lora_rank must be an int >= 1, got {rank!r}")
        self.named_paths()  # checks the entries

    def named_paths(self) -> dict[str, str]:
        """lora_paths as adapter name -> directory."""
        named = {}
        for entry in self.lora_paths or ():
            name, eq, path = entry.partition("=")
            name, path = (name, path) if eq else (entry, entry)
            if not name or not path:
                raise ValueError(f"lora_paths entries are NAME=PATH or PATH, got {entry!r}")
            if name in named:
                raise ValueError(f"lora_paths names adapter {name!r} twice")
            named[name] = path
        return named
