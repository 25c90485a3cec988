"""LoRA serving: a fixed number of adapter slots on a model's projections.

`AdapterSlots(model, ...)` gives every targeted linear layer of the model a LoraLayer (A and B
buffers for `max_loras_per_batch` slots, this rank's slices under tensor parallelism) and
keeps which named adapter sits in which slot. Loading copies an adapter into a free slot;
unloading zeroes it. A forward batch mixes rows of any loaded adapters with base-only rows:
the runner says which slot each token row uses before the forward (`prepare_batch`, or
`batch.prepare` with the token slots), and each layer adds its rows' deltas.

How a layer applies it (the wiring in rollout.models.layers): a Linear has an attribute
`lora` (None until AdapterSlots sets it), and adds the delta to its output before any
all-reduce:

    if self.lora is None:
        return self.base(x, out)  # the GEMM (RowParallelLinear: then self.tp.all_reduce)
    # x: this layer's input (this rank's slice when row-parallel); the delta is added to
    # base(x)'s output in place, after it or beside it (LoraLayer.around): where the GEMM
    # wrote into `out` (a symmetric buffer, forward/symmetric_sum.py), the delta lands there
    return self.lora.around(x, functools.partial(self.base, x, out))

A projection whose output goes straight to a kernel that can add a delta as it reads it (the
model's `lora_delta_consumers`: SiLU-and-mul after gate/up, the norm after o_proj and down_proj)
is linked to it: with the batch running LoRA beside the GEMMs (`run_beside`), its delta is
added there instead of by a launch of its own (LoraLayer.around).

Writing a slot is not atomic with respect to a forward: the engine loads, replaces and unloads
adapters between steps, never while a batch that uses the slot is running.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rollout.models.layers import MergedLinear, RMSNorm, RowParallelLinear, SiluAndMulMLP, kernel
from rollout.models.lora_adapter import (
    LORA_MODULES,
    AdapterError,
    LoraAdapter,
    parse_tensor_name,
    read_peft_adapter,
    resolve_target_modules,
)
from rollout.models.lora_layer import LoraBatch, LoraLayer
from rollout.models.lora_values import ValueKey, ValueWrites

# Token rows the batch buffers hold in place: at least the largest CUDA-graph batch.
DEFAULT_MAX_TOKENS = 1024


def lora_module_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """HF module name ("model.layers.0.self_attn.q_proj") -> the full (out, in) of every
    projection of `model` that LoRA can change, whatever this rank holds of it."""
    shapes = {}
    for hf_name, (shape, _) in model.hf_param_shapes().items():
        module, _, kind = hf_name.rpartition(".")
        if kind == "weight" and module.rsplit(".", 1)[-1] in LORA_MODULES:
            shapes[module] = (shape[0], shape[1])
    return shapes


@dataclass(frozen=True)
class AdapterLayout:
    """What a loaded adapter is, apart from its values: an update of its values in place
    (weight sync) must keep all of it."""

    rank: int
    scale: float
    modules: frozenset[str]  # HF module names


class AdapterSlots:
    """Named LoRA adapters in `max_loras_per_batch` fixed slots of `model`'s projections
    among `target_modules`, of rank up to `max_lora_rank`. With `use_kernels` the layers run
    the Triton kernels (rollout_kernels.lora_shrink / lora_expand), else torch ops."""

    def __init__(
        self,
        model: nn.Module,
        max_loras_per_batch: int,
        max_lora_rank: int,
        target_modules: str | Sequence[str] = "all",
        max_tokens: int = DEFAULT_MAX_TOKENS,
        use_kernels: bool = False,
    ) -> None:
        if max_loras_per_batch < 1 or max_lora_rank < 1:
            raise ValueError(
                f"max_loras_per_batch and max_lora_rank must be >= 1, got "
                f"{max_loras_per_batch} and {max_lora_rank}"
            )
        self.num_slots, self.max_rank = max_loras_per_batch, max_lora_rank
        self.target_modules = resolve_target_modules(target_modules)
        self.module_shapes = lora_module_shapes(model)
        weight = next(model.parameters())
        self.batch = LoraBatch(max_loras_per_batch, max_tokens, weight.device, use_kernels)
        self.layers: dict[str, LoraLayer] = {}  # model module name -> its slots
        self._targets: dict[str, tuple[LoraLayer, str]] = {}  # HF module -> (layer, part)
        self._slots: dict[str, int] = {}  # adapter name -> slot
        self._layouts: dict[str, AdapterLayout] = {}  # adapter name -> its rank, scale, modules
        # Adapter name -> its last update's checked layout; dropped when it loads or unloads.
        self._writes: dict[str, ValueWrites] = {}
        taken = [n for n, m in model.named_modules() if getattr(m, "lora", None) is not None]
        if taken:
            raise ValueError(f"{taken[0]} already has LoRA slots: detach them first")
        for name, module in model.named_modules():
            self._attach(name, module)
        consumers = getattr(model, "lora_delta_consumers", None)
        for projection, consumer in [] if consumers is None else consumers():
            if projection.lora is not None:
                projection.lora.defers = True
                consumer.lora_delta = projection.lora

    def _attach(self, name: str, module: nn.Module) -> None:
        parent = name.rpartition(".")[0]
        if isinstance(module, MergedLinear):
            hf = {f"{parent}.{part}": part for part in module.parts}
            a_shard, b_shards = None, module.part_shards
            sizes = dict(module.parts)
        elif isinstance(module, RowParallelLinear):
            part = name.rsplit(".", 1)[-1]
            hf, a_shard, b_shards = {name: part}, module.hf_shards["weight"], None
            sizes = {part: module.out_features}
        else:
            return
        if not set(hf.values()) & self.target_modules:
            return
        layer = LoraLayer(
            sizes,
            module.in_features,
            self.max_rank,
            self.batch,
            module.weight.dtype,
            module.weight.device,
            a_shard,
            b_shards,
        )
        module.lora = layer
        self.layers[name] = layer
        for hf_module, part in hf.items():
            if part in self.target_modules:
                self._targets[hf_module] = (layer, part)

    @property
    def loaded(self) -> dict[str, int]:
        """Adapter name -> slot, for every loaded adapter."""
        return dict(self._slots)

    @property
    def nbytes(self) -> int:
        """Device memory the slots take."""
        return sum(layer.nbytes for layer in self.layers.values())

    def slot_of(self, name: str) -> int:
        """The slot of adapter `name`; AdapterError when none of that name is loaded."""
        if name not in self._slots:
            loaded = ", ".join(sorted(self._slots)) or "none"
            raise AdapterError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        return self._slots[name]

    def read(self, path: str, roots: Sequence[str] | None = None) -> LoraAdapter:
        """Reads and checks the PEFT adapter in directory `path` against this model."""
        adapter = read_peft_adapter(path, self.module_shapes, self.max_rank, roots)
        self.check(adapter)
        return adapter

    def check(self, adapter: LoraAdapter) -> None:
        """AdapterError unless `adapter` fits these slots: rank, projections, shapes."""
        if adapter.rank > self.max_rank:
            raise AdapterError(f"rank {adapter.rank} is above max_lora_rank {self.max_rank}")
        extra = adapter.projections - self.target_modules
        if extra:
            raise AdapterError(
                f"the adapter changes {', '.join(sorted(extra))}, which lora_target_modules "
                f"({', '.join(sorted(self.target_modules))}) does not include"
            )
        for module, (a, b) in adapter.modules.items():
            want = self.module_shapes.get(module)
            got = (b.shape[0], a.shape[1])
            if want != got or a.shape[0] != adapter.rank or b.shape[1] != adapter.rank:
                raise AdapterError(
                    f"{module}: A {list(a.shape)} and B {list(b.shape)} do not fit the "
                    f"model's projection {want} at rank {adapter.rank}"
                )

    def load(self, name: str, adapter: LoraAdapter) -> int:
        """Copies `adapter` into a free slot under `name` (or over the slot `name` already
        has: a new version of it) and returns the slot. Checked before any slot changes:
        AdapterError, and nothing loaded, when it does not fit or every slot is taken."""
        self.check(adapter)
        slot = self._slots.get(name)
        if slot is None:
            free = sorted(set(range(self.num_slots)) - set(self._slots.values()))
            if not free:
                raise AdapterError(
                    f"all {self.num_slots} LoRA slots (max_loras_per_batch) are in use by "
                    f"{', '.join(sorted(self._slots))}: unload one first"
                )
            slot = free[0]
        self._clear(slot)
        self._writes.pop(name, None)
        for module, (a, b) in adapter.modules.items():
            layer, part = self._targets[module]
            layer.write(slot, part, a, b, adapter.scale)
        self.batch.ranks[slot] = adapter.rank
        self._slots[name] = slot
        self._layouts[name] = AdapterLayout(adapter.rank, adapter.scale, frozenset(adapter.modules))
        self._publish()
        return slot

    def load_path(self, name: str, path: str, roots: Sequence[str] | None = None) -> int:
        """`load(name, read(path, roots))`."""
        return self.load(name, self.read(path, roots))

    def unload(self, name: str) -> None:
        """Frees the slot of adapter `name` (zeroed: a row still pointing at it adds nothing).
        AdapterError when none of that name is loaded."""
        slot = self.slot_of(name)
        del self._slots[name]
        del self._layouts[name]
        self._writes.pop(name, None)
        self._clear(slot)
        self._publish()

    def layout(self, name: str) -> AdapterLayout:
        """The rank, scale and modules of loaded adapter `name` (AdapterError when none is)."""
        self.slot_of(name)
        return self._layouts[name]

    def check_values(
        self, name: str, shapes: Iterable[tuple[str, Sequence[int]]]
    ) -> dict[str, tuple[str, str]]:
        """Checks new values for some modules of loaded adapter `name`, from each PEFT-named
        tensor's shape, before any arrives; returns tensor name -> (HF module, "A" or "B").
        Each module given must be one the adapter has, with both its lora_A [rank, in] and
        lora_B [out, rank] at the adapter's rank; modules not given keep their values.
        AdapterError naming what is wrong otherwise (a rank, alpha or module set of its own
        is a new adapter: load it from a directory)."""
        layout = self.layout(name)
        found: dict[str, tuple[str, str]] = {}
        halves: dict[str, set[str]] = {}
        for tensor_name, shape in shapes:
            module, kind = parse_tensor_name(tensor_name, self.module_shapes)
            if module not in layout.modules:
                raise AdapterError(
                    f"{tensor_name}: adapter {name!r} has no LoRA weights on {module} (an update "
                    f"changes the values of the modules it was loaded with; load a new adapter "
                    f"to change which modules it adapts)"
                )
            if kind in halves.setdefault(module, set()):
                raise AdapterError(f"{tensor_name}: lora_{kind} of {module} is given twice")
            halves[module].add(kind)
            out_features, in_features = self.module_shapes[module]
            want = (layout.rank, in_features) if kind == "A" else (out_features, layout.rank)
            if tuple(shape) != want:
                raise AdapterError(
                    f"{tensor_name} has shape {list(shape)}, expected {list(want)} (adapter "
                    f"{name!r} has rank {layout.rank}; the projection is {in_features} -> "
                    f"{out_features})"
                )
            found[tensor_name] = (module, kind)
        if not found:
            raise AdapterError(f"the update of adapter {name!r} holds no LoRA weights")
        for module, kinds in sorted(halves.items()):
            if kinds != {"A", "B"}:
                missing = "lora_B" if "A" in kinds else "lora_A"
                raise AdapterError(
                    f"{module}: the update gives one half of it without its {missing}: give "
                    f"both halves of every module it changes"
                )
        return found

    def value_writes(self, name: str, shapes: Iterable[tuple[str, Sequence[int]]]) -> ValueWrites:
        """`check_values` of PEFT-named tensors of these shapes, and where each is copied:
        the same names and shapes as the adapter's last update reuse that one's, unchecked."""
        key: ValueKey = tuple((tensor_name, tuple(shape)) for tensor_name, shape in shapes)
        kept = self._writes.get(name)
        if kept is not None and kept.key == key:
            return kept
        found = self.check_values(name, key)
        slot, rank = self.slot_of(name), self.layout(name).rank
        targets, shards = [], []
        for tensor_name, _ in key:
            module, kind = found[tensor_name]
            layer, part = self._targets[module]
            i = 0 if kind == "A" else 1
            targets.append(layer.value_views(slot, part, rank)[i])
            shards.append(layer.shards(part)[i])
        modules = len({module for module, _ in found.values()})
        self._writes[name] = ValueWrites(key, targets, shards, modules)
        return self._writes[name]

    def write_values(self, name: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Copies new values of some modules (PEFT-named full tensors, any floating dtype) into
        loaded adapter `name`'s slot, checked first as `check_values` does; its other modules,
        rank and scale stay. Returns how many modules were written."""
        writes = self.value_writes(name, [(n, t.shape) for n, t in tensors])
        # NOTE: a slot's rows past its adapter's rank are zero from its load on, and an update
        # keeps the rank: copying the first `rank` of them is the whole write.
        writes.write([t for _, t in tensors])
        return writes.modules

    def compile_kernels(self) -> None:
        """Runs every layer's kernels once at a batch size of each of their launch classes
        (rows of slot 0, whatever it holds, the outputs dropped): a prefill then compiles no
        Triton variant while serving. CUDA graphs cover decode at their sizes; an eager
        prefill of some class would otherwise compile inside the first request that has it."""
        if not self.batch.use_kernels:
            return
        for rows in kernel("lora_shrink").LAUNCH_CLASS_ROWS:
            self.batch.prepare(torch.zeros(rows, dtype=torch.int32))
            for layer in self.layers.values():
                x = layer.a.new_zeros(rows, layer.a.shape[-1])
                layer.apply(x, layer.b.new_zeros(rows, layer.b.shape[1]))
        self.batch.prepare(torch.zeros(0, dtype=torch.int32), active=False)

    def run_beside(self, max_rows: int) -> None:
        """Forwards of up to `max_rows` rows run each layer's LoRA kernels beside its base
        GEMM, and the linked projections' deltas are added by the kernels after them
        (LoraLayer.around); 0: never. Only on the kernels' path."""
        self.batch.run_beside(max_rows)

    def detach(self, model: nn.Module) -> None:
        """Takes the slots off `model`'s layers: it computes the base model only again."""
        for name in self.layers:
            model.get_submodule(name).lora = None
        for module in model.modules():
            if isinstance(module, (RMSNorm, SiluAndMulMLP)):
                module.lora_delta = None

    def _clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.clear(slot)
        self.batch.ranks[slot] = 0

    def _publish(self) -> None:
        self.batch.live_slots = tuple(sorted(self._slots.values()))

    def prepare_batch(self, adapters: Sequence[str | None], extend_lens: Sequence[int]) -> None:
        """Prepares the next forward from each request's adapter name (None: the base model)
        and its number of new tokens, in batch order. AdapterError for a name not loaded."""
        slots = [-1 if name is None else self.slot_of(name) for name in adapters]
        self.batch.prepare_requests(slots, extend_lens)


__all__ = ["AdapterError", "AdapterLayout", "AdapterSlots", "LoraAdapter", "lora_module_shapes"]
