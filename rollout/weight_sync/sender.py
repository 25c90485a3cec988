"""WeightSender: the trainer's side of a weight update, in a few lines of trainer code.

    sender = WeightSender(engine, method="tensor")       # or "distributed", "disk"
    sender.push(policy_model, weight_version=f"step-{step}")

It takes an nn.Module (its named parameters, HF names) or a dict of HF name -> tensor, casts to
the engine's dtype, and pushes through one of the three paths. `target` is a RolloutEngine or
anything with the same methods (RolloutClient). Every push is one transaction on the engine:
all weights or none.

- tensor: tensors already in the engine's dtype on a GPU are sent as they are (their IPC
  handles stay the same from step to step); an adapter's, and others, are packed into buckets that this sender
  keeps between steps (same buffers, same handles: the receiver doesn't reopen them). By
  default all buckets go in one call, so the trainer holds one packed copy; with
  `stream_buckets=True` one bucket buffer is reused call after call while generation is
  paused (in place), which the engine applies together when it continues.
- distributed: the engine joins a group this sender creates (rank 0), each of its
  tensor-parallel ranks as a member of its own, with SGLang's rendezvous (so an SGLang engine
  joins it too); one broadcast per tensor, or one for the whole push with
  load_format="flattened_bucket" (SGLang's wire format: see distributed_source.py).
- disk: writes a safetensors checkpoint (with the engine's config.json) to `disk_dir`.

A PEFT model (LoRA parameters, adapter_weights.py) pushes only its active adapter's lora_A /
lora_B tensors, to the adapter the engine has loaded as `lora_name` (through disk: a PEFT
adapter directory). A rank-32 adapter is a fraction of a percent of the model's bytes.

    sender.push(peft_model, weight_version=f"step-{step}", lora_name="policy")
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from rollout.weight_sync import adapter_weights, distributed_source
from rollout.weight_sync.calls import DEFAULT_GROUP, UpdateWeightsFromDistributed
from rollout.weight_sync.flat_bucket import FlatBucket, layout
from rollout.weight_sync.specs import WeightSpec, check_unique, dtype_name, parse_dtype
from rollout.weight_sync.update_group import UpdateGroup

METHODS = ("tensor", "distributed", "disk")
DEFAULT_BUCKET_BYTES = 512 << 20


def named_weights(weights: nn.Module | Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of a module's parameters (tied ones once) or of a dict."""
    if isinstance(weights, nn.Module):
        pairs = [(n, p.detach()) for n, p in weights.named_parameters()]
    elif isinstance(weights, Mapping):
        pairs = [(n, t.detach() if isinstance(t, torch.Tensor) else t) for n, t in weights.items()]
    else:
        raise TypeError(f"weights must be an nn.Module or a dict of name -> tensor, got {type(weights).__name__}")
    bad = [n for n, t in pairs if not isinstance(n, str) or not isinstance(t, torch.Tensor)]
    if bad or not pairs:
        raise TypeError(f"weights must map names to tensors; bad entries: {bad[:3]}" if bad else "no weights given")
    check_unique([n for n, _ in pairs])
    return pairs


class WeightSender:
    def __init__(
        self,
        target: Any,
        method: str = "tensor",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        stream_buckets: bool = False,
        disk_dir: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """lora_name: the engine's adapter that a push goes to when it names none."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if method == "disk" and not disk_dir:
            raise ValueError("method='disk' needs disk_dir, where the checkpoint is written")
        self.target, self.method = target, method
        self.bucket_bytes, self.stream_buckets, self.disk_dir = bucket_bytes, stream_buckets, disk_dir
        info = target.get_server_info()
        self.dtype = parse_dtype(info["dtype"])
        self.engine_model_path = info.get("model_path")
        # Every rank of the target joins the update group: an engine's tensor-parallel ranks,
        # or all the replicas' ranks of a RolloutPool.
        self.engine_ranks = info.get("weight_group_ranks", info.get("tp_size", 1))
        self.group: UpdateGroup | None = None
        self.lora_name = lora_name
        self._lora: str | None = None  # the adapter the push under way goes to
        self._buckets: list[FlatBucket] = []
        self._bucket_key: Any = None  # the names, shapes and device the kept buckets are for
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-sender")

    # ---- distributed ------------------------------------------------------------------------
    def init_group(
        self, master_address: str, master_port: int, backend: str = "nccl",
        group_name: str = DEFAULT_GROUP, timeout_s: float = 300.0, device: Any = None,
    ) -> None:  # fmt: skip
        """Creates the update group (this process is rank 0) and has the engine join it.
        `device`: this process's GPU for NCCL."""
        if self.method != "distributed":
            raise ValueError(f"init_group is for method='distributed', this sender uses {self.method!r}")
        world = 1 + self.engine_ranks
        joined = self._pool.submit(
            self.target.init_weights_update_group,
            master_address, master_port, 1, world, group_name, backend, timeout_s,
        )  # fmt: skip
        try:
            self.group = UpdateGroup.join(
                master_address, master_port, 0, world, group_name, backend, timeout_s, device
            )
        finally:
            joined.result()  # the engine's error, if it failed to join

    # ---- pushing ----------------------------------------------------------------------------
    def push(
        self, weights: nn.Module | Mapping[str, torch.Tensor], weight_version: str | None = None,
        load_format: str | None = None, lora_name: str | None = None,
    ) -> dict:  # fmt: skip
        """Pushes every weight; returns the engine's result (it raises if the update failed,
        leaving the engine's previous weights serving). `load_format` is for distributed.
        A PEFT model pushes only its adapter, to the engine's loaded adapter `lora_name` (a
        dict of PEFT-named LoRA tensors does too, with lora_name)."""
        lora_name = lora_name or self.lora_name
        is_peft = isinstance(weights, nn.Module) and adapter_weights.has_lora(weights)
        if is_peft and lora_name is None:
            raise ValueError(
                f"{type(weights).__name__} has LoRA weights: pass lora_name (the adapter the "
                f"engine loaded) to push the adapter, or push the merged model "
                f"(merge_and_unload()) to the base weights"
            )
        if lora_name is not None:
            named = adapter_weights.lora_weights(weights) if is_peft else named_weights(weights)
            if isinstance(weights, nn.Module) and not is_peft:
                raise ValueError(f"lora_name={lora_name!r} needs a PEFT model or a dict of LoRA tensors")
            self._lora = lora_name
        else:
            named, self._lora = named_weights(weights), None
        if self.method == "distributed":
            return self._push_distributed(named, weight_version, load_format)
        if self.method == "disk":
            if lora_name is not None:
                return self._push_adapter_dir(weights, named, weight_version)
            return self._push_disk(named, weight_version)
        return self._push_tensor(named, weight_version)

    def _lora_kw(self) -> dict[str, str]:
        """lora_name for the engine's call, only when pushing an adapter (an SGLang target
        has no such argument)."""
        return {} if self._lora is None else {"lora_name": self._lora}

    def _push_adapter_dir(self, weights: Any, named: list, version: str | None) -> dict:
        if not isinstance(weights, nn.Module):
            raise ValueError("a disk push of an adapter needs the PeftModel (its adapter_config)")
        assert self.disk_dir is not None
        config = adapter_weights.adapter_config(weights)
        named = [(n, t.to(self.dtype)) for n, t in named]
        adapter_weights.write_adapter_dir(self.disk_dir, config, named)
        return self.target.update_weights_from_disk(
            self.disk_dir, weight_version=version, lora_name=self._lora
        )

    def _push_distributed(self, named: list, version: str | None, load_format: str | None) -> dict:
        if self.group is None:
            raise RuntimeError("call init_group before pushing through the distributed path")
        named = [(n, t.to(self.dtype)) for n, t in named]
        args = (
            [n for n, _ in named], [dtype_name(self.dtype)] * len(named), [list(t.shape) for _, t in named],
            self.group.name, True, version, load_format,
        )  # fmt: skip
        # NOTE: checked here, before the first broadcast: a call refused before the engine takes
        # the broadcasts would leave this rank sending to nobody until the group's timeout, and
        # the group broken on both sides.
        lora = self._lora_kw()
        UpdateWeightsFromDistributed(*args, **lora)
        done = self._pool.submit(self.target.update_weights_from_distributed, *args, **lora)
        try:
            distributed_source.send(self.group, named, load_format)
        finally:
            result = done.result()
        return result

    def _push_tensor(self, named: list, version: str | None) -> dict:
        # An adapter is many small tensors: one kept bucket (one handle for the receiver to
        # open) costs less than a handle per tensor, and its copy is a fraction of a model's.
        as_is = self._lora is None and all(
            t.is_cuda and t.dtype == self.dtype and t.is_contiguous() for _, t in named
        )
        if as_is:
            return self.target.update_weights_from_tensor(named, weight_version=version, **self._lora_kw())
        if not self.stream_buckets:
            buckets, start = self._ensure_buckets(named), 0
            for bucket in buckets:  # each holds the next run of `named`
                bucket.fill(named[start : start + len(bucket.entries)])
                start += len(bucket.entries)
            return self.target.update_weights_from_tensor(
                buckets, "flattened_bucket", weight_version=version, **self._lora_kw()
            )
        return self._push_streamed(self._bucket_groups(named), named[0][1].device, version)

    def _push_streamed(self, groups: list, device: torch.device, version: str | None) -> dict:
        was_paused = self.target.get_server_info().get("generation_paused") is not None
        if not was_paused:
            self.target.pause_generation(mode="in_place")
        try:
            for group in groups:
                specs = [WeightSpec(n, tuple(t.shape), self.dtype) for n, t in group]
                bucket = self._shared_bucket(specs, device)
                bucket.fill(group)
                self.target.update_weights_from_tensor(
                    bucket, "flattened_bucket", weight_version=version, **self._lora_kw()
                )
        finally:
            result = self.target.continue_generation() if not was_paused else {"success": True}
        return result

    def _bucket_groups(self, named: list) -> list[list[tuple[str, torch.Tensor]]]:
        groups, size = [[]], 0
        for name, tensor in named:
            nbytes = tensor.numel() * self.dtype.itemsize
            # NOTE: a LoRA module's lora_B stays with its lora_A: an adapter update carries
            # both halves of every module it changes.
            pair = bool(groups[-1]) and groups[-1][-1][0].replace(".lora_A.", ".lora_B.") == name
            if groups[-1] and size + nbytes > self.bucket_bytes and not pair:
                groups.append([])
                size = 0
            groups[-1].append((name, tensor))
            size += nbytes
        return groups

    def _ensure_buckets(self, named: list) -> list[FlatBucket]:
        """One kept bucket per group of `named` (_bucket_groups), in order; made again only
        when the names, shapes or device change (a step's push repeats the last one's)."""
        device = named[0][1].device
        key = ([(n, t.shape) for n, t in named], device)
        if key != self._bucket_key:
            self.free_buckets()
            groups = self._bucket_groups(named)
            specs = [[WeightSpec(n, tuple(t.shape), self.dtype) for n, t in g] for g in groups]
            self._buckets = [FlatBucket.allocate(group, device) for group in specs]
            self._bucket_key = key
        return self._buckets

    def _shared_bucket(self, specs: list[WeightSpec], device: torch.device) -> FlatBucket:
        """A bucket for `specs` over the one kept buffer (grown when too small)."""
        entries, nbytes = layout(specs)
        kept = self._buckets[0] if len(self._buckets) == 1 and not self._buckets[0].entries else None
        if kept is None or kept.buffer.numel() < nbytes or kept.device != device:
            self.free_buckets()
            kept = FlatBucket.allocate_raw(max(nbytes, self.bucket_bytes), device)
            self._buckets = [kept]
        base = kept
        return FlatBucket(base.buffer[:nbytes], entries, base.block)

    def _push_disk(self, named: list, version: str | None) -> dict:
        from safetensors.torch import save_file

        assert self.disk_dir is not None
        os.makedirs(self.disk_dir, exist_ok=True)
        config = os.path.join(self.engine_model_path or "", "config.json")
        if not os.path.isfile(config):
            raise FileNotFoundError(f"the engine's config.json is not readable here ({config}); copy it to {self.disk_dir}")
        shutil.copyfile(config, os.path.join(self.disk_dir, "config.json"))
        tensors = {n: t.to("cpu", self.dtype).contiguous() for n, t in named}
        save_file(tensors, os.path.join(self.disk_dir, "model.safetensors"))
        return self.target.update_weights_from_disk(self.disk_dir, weight_version=version)

    # ---- teardown ---------------------------------------------------------------------------
    def free_buckets(self) -> None:
        for bucket in self._buckets:
            bucket.close()
        self._buckets = []
        self._bucket_key = None

    def close(self) -> None:
        """Leaves the update group (the engine too) and frees the buckets."""
        if self.group is not None:
            # Both ends leave at once: NCCL's shutdown finalizes with the other ranks.
            left = self._pool.submit(self.target.destroy_weights_update_group, self.group.name)
            self.group.close()
            self.group = None
            try:
                left.result()
            except (ValueError, RuntimeError):
                pass  # the engine already dropped it
        self.free_buckets()
        self._pool.shutdown(wait=False)
