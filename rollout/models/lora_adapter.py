"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

An adapter adds scale * B @ A to some of a decoder's projections (q/k/v/o, gate/up/down). It is
read and checked whole against the model's projection shapes before anything is copied into a
slot, so a bad adapter is an AdapterError that changes nothing. What PEFT can express beyond
plain LoRA on those projections (biases, DoRA, extra trained modules, per-module ranks) is
refused by name rather than served wrongly.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from rollout.models.loader import open_checked

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT's names: base_model.model.<HF module>.lora_A.weight (the prefix may be dropped, and a
# live PeftModel's parameters carry the adapter's name before ".weight").
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>model\.layers\.\d+\.(?:self_attn|mlp)\.(?P<proj>\w+))"
    r"\.lora_(?P<kind>[AB])(?:\.[\w-]+)?\.weight$"
)
# Config fields whose non-default values change what an adapter computes: (is it the
# default?, what it is), for the error naming what is not supported.
_UNSUPPORTED = {
    "bias": (lambda v: v in (None, "none"), "trained bias terms"),
    "lora_bias": (lambda v: not v, "a bias on lora_B"),
    "use_dora": (lambda v: not v, "DoRA"),
    "modules_to_save": (lambda v: not v, "fully trained extra modules"),
    "rank_pattern": (lambda v: not v, "per-module ranks"),
    "alpha_pattern": (lambda v: not v, "per-module alphas"),
    "fan_in_fan_out": (lambda v: not v, "transposed (Conv1D) weights"),
    "layer_replication": (lambda v: not v, "replicated layers"),
    "target_parameters": (lambda v: not v, "LoRA on bare parameters"),
    "trainable_token_indices": (lambda v: not v, "trained token embeddings"),
    "alora_invocation_tokens": (lambda v: not v, "activated LoRA"),
    "use_qalora": (lambda v: not v, "QA-LoRA"),
}


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names what is wrong and what would do."""


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter: per HF module name ("model.layers.0.self_attn.q_proj"), its
    (A [rank, in], B [out, rank]) in the checkpoint's full shapes, on the device they came on."""

    rank: int
    scale: float  # alpha / rank, or alpha / sqrt(rank) for rsLoRA
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def projections(self) -> frozenset[str]:
        """The kinds of projection it changes, e.g. {"q_proj", "v_proj"}."""
        return frozenset(name.rsplit(".", 1)[1] for name in self.modules)


@dataclass(frozen=True)
class AdapterConfig:
    """What this engine reads of adapter_config.json."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: str | tuple[str, ...]  # names (PEFT suffix match) or one regex

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def targets(self, module: str) -> bool:
        """Does target_modules name this HF module, as PEFT matches it?"""
        if isinstance(self.target_modules, str):
            return self.target_modules == "all-linear" or bool(
                re.fullmatch(self.target_modules, module)
            )
        return any(module == t or module.endswith("." + t) for t in self.target_modules)


def resolve_target_modules(option: str | Sequence[str]) -> frozenset[str]:
    """The projections of the `lora_target_modules` option: "all" (or "all-linear"), or names
    among LORA_MODULES (a comma-separated string or a sequence)."""
    names = option.split(",") if isinstance(option, str) else list(option)
    names = [n.strip() for n in names if n.strip()]
    if names in (["all"], ["all-linear"]):
        return frozenset(LORA_MODULES)
    unknown = [n for n in names if n not in LORA_MODULES]
    if unknown or not names:
        raise ValueError(
            f"lora_target_modules must be 'all' or names among {', '.join(LORA_MODULES)}, "
            f"got {option!r}"
        )
    return frozenset(names)


def parse_adapter_config(config: Mapping[str, Any], max_rank: int) -> AdapterConfig:
    """Checks a parsed adapter_config.json. AdapterError for an adapter this engine cannot
    serve: another PEFT method, a rank above `max_rank`, a feature beyond plain LoRA, or a
    target module other than the decoder's projections."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type must be LORA, got {config.get('peft_type')!r}")
    for key, (is_default, what) in _UNSUPPORTED.items():
        if not is_default(config.get(key)):
            raise AdapterError(f"{key}={config[key]!r} ({what}) is not supported: plain LoRA only")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"rank {rank} is above max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:
            raise AdapterError(f"target_modules {targets!r} is not a valid regex: {e}") from None
    elif (
        isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) for t in targets)
    ):
        unknown = sorted({t for t in targets if t.rsplit(".", 1)[-1] not in LORA_MODULES})
        if unknown:
            raise AdapterError(
                f"unknown target module(s) {', '.join(unknown)}: LoRA applies to "
                f"{', '.join(LORA_MODULES)}"
            )
        targets = tuple(targets)
    else:
        raise AdapterError(f"target_modules must be a list of names or a regex, got {targets!r}")
    return AdapterConfig(rank, float(alpha), bool(config.get("use_rslora", False)), targets)


def adapter_from_tensors(
    config: AdapterConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    module_shapes: Mapping[str, tuple[int, int]],
) -> LoraAdapter:
    """The adapter of PEFT-named tensors, checked against `module_shapes` (HF module name ->
    the full (out, in) of the model's projection). AdapterError for a name that is not a LoRA
    weight of a known projection, a module target_modules does not name, an A without its B,
    or a shape other than A [r, in], B [out, r]."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, kind = parse_tensor_name(name, module_shapes)
        proj = module.rsplit(".", 1)[1]
        if not config.targets(module):
            raise AdapterError(f"{name}: target_modules {config.target_modules!r} omits {proj}")
        if not tensor.is_floating_point():
            raise AdapterError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
        halves.setdefault(module, {})[kind] = tensor
    if not halves:
        raise AdapterError("the adapter holds no LoRA weights")
    modules = {}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(f"{module} has no {missing} weight")
        out_features, in_features = module_shapes[module]
        for kind, want in (("A", (config.rank, in_features)), ("B", (out_features, config.rank))):
            if tuple(pair[kind].shape) != want:
                raise AdapterError(
                    f"{module}.lora_{kind}.weight has shape {list(pair[kind].shape)}, expected "
                    f"{list(want)} (r={config.rank}, the projection is {in_features} -> "
                    f"{out_features})"
                )
        modules[module] = (pair["A"], pair["B"])
    return LoraAdapter(config.rank, config.scale, modules)


def parse_tensor_name(name: str, module_shapes: Mapping[str, tuple[int, int]]) -> tuple[str, str]:
    """(HF module, "A" or "B") of a PEFT-named LoRA weight of one of the model's projections
    (`module_shapes`: HF module -> (out, in)); AdapterError for any other name."""
    match = _TENSOR_NAME.match(name)
    if match is None:
        raise AdapterError(_unexpected_tensor(name))
    module = match["module"]
    if module not in module_shapes:
        known = ", ".join(LORA_MODULES)
        raise AdapterError(
            f"{name}: the model has no projection {module} (LoRA applies to {known} of "
            f"layers 0..{_num_layers(module_shapes) - 1})"
        )
    return module, match["kind"]


def read_peft_adapter(
    path: str,
    module_shapes: Mapping[str, tuple[int, int]],
    max_rank: int,
    roots: Sequence[str] | None = None,
) -> LoraAdapter:
    """Reads and checks the PEFT adapter saved in directory `path` (CPU tensors). With
    `roots`, both files must resolve under one of them (rollout.models.loader.open_checked).
    AdapterError for anything the adapter gets wrong, FileNotFoundError for missing files."""
    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.lexists(config_path):
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}: not a PEFT adapter directory")
    if not os.path.lexists(weights_path):
        pickle = os.path.lexists(os.path.join(path, "adapter_model.bin"))
        hint = " (adapter_model.bin is never read: save with safe_serialization=True)"
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {path}" + (hint if pickle else ""))
    with open_checked(config_path, CONFIG_FILE, roots) as readable, open(readable) as f:
        try:
            raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    config = parse_adapter_config(raw, max_rank)
    with open_checked(weights_path, WEIGHTS_FILE, roots) as readable:
        try:
            with safe_open(readable, framework="pt") as f:
                tensors = [(name, f.get_tensor(name)) for name in f.keys()]
        except SafetensorError as e:  # cut short, or not safetensors at all
            raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file: {e}") from None
    return adapter_from_tensors(config, tensors, module_shapes)


def _unexpected_tensor(name: str) -> str:
    if "lora_magnitude_vector" in name:
        return f"{name}: DoRA adapters are not supported"
    if ".lora_B" in name and name.endswith(".bias"):
        return f"{name}: LoRA biases (lora_bias) are not supported"
    if "lora_embedding" in name:
        return f"{name}: LoRA on embeddings is not supported (projections only)"
    if ".lora_A" in name or ".lora_B" in name:
        module = name.split(".lora_")[0].removeprefix("base_model.model.")
        return f"{name}: LoRA on {module} is not supported: only {', '.join(LORA_MODULES)}"
    return (
        f"unexpected tensor {name!r}: a LoRA adapter holds only "
        f"base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight"
    )


def _num_layers(module_shapes: Mapping[str, tuple[int, int]]) -> int:
    return 1 + max((int(m.split(".")[2]) for m in module_shapes), default=-1)
