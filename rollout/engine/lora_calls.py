"""The LoRA adapter control calls: load one from a PEFT directory into a free slot, unload one.

Both run in the scheduler between steps (rollout/engine/lora_manager.py). Over HTTP they are
admin-only, and a load reads only files under the server's --allowed-weight-roots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rollout.control import ControlCall, nonempty_str, settle
from rollout.errors import InvalidRequest
from rollout.text_checks import check_label


@dataclass(frozen=True)
class LoadLoraAdapter(ControlCall):
    """Load the PEFT adapter in directory `lora_path` (adapter_config.json +
    adapter_model.safetensors) under `lora_name`; requests then pick it with lora_path=lora_name.
    Refused, changing nothing, when the name is taken, the adapter does not fit the slots
    (rank above max_lora_rank, a projection outside lora_target_modules, wrong shapes) or every
    slot is in use. allowed_roots: None reads anywhere; else every file must resolve under one."""

    method: ClassVar[str] = "load_lora_adapter"
    lora_name: str
    lora_path: str
    allowed_roots: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        nonempty_str(self.lora_name, "lora_name")
        nonempty_str(self.lora_path, "lora_path")
        check_label(self.lora_name, "lora_name")  # it is named in every listing of adapters
        if ":" in self.lora_name:
            raise InvalidRequest(
                f"lora_name must not contain ':' (the OpenAI API's model is '<base>:<adapter>'), "
                f"got {self.lora_name!r}"
            )
        roots = self.allowed_roots
        if roots is not None:
            if not isinstance(roots, (list, tuple)) or not all(
                isinstance(r, str) and r for r in roots
            ):
                raise InvalidRequest(f"allowed_roots must be a list of directories, got {roots!r:.200}")
            settle(self, "allowed_roots", tuple(roots))


@dataclass(frozen=True)
class UnloadLoraAdapter(ControlCall):
    """Unload adapter `lora_name`, freeing its slot. Refused while a queued or running request
    uses it."""

    method: ClassVar[str] = "unload_lora_adapter"
    lora_name: str

    def __post_init__(self) -> None:
        nonempty_str(self.lora_name, "lora_name")


LORA_CALLS = (LoadLoraAdapter, UnloadLoraAdapter)
