"""One tensor-parallel rank of tests/test_tensor_parallel_model.py, run in a spawned process.

Each rank builds the same cases twice, as the whole model (tp=1, no communication) and as its
shard of a gloo group, runs a prefill then decode steps through the torch attention backend
and a KV pool sized by the model's per-rank heads, and writes how far the gathered logits are
from the whole model's to rank<r>.json. Only this module (not the test module) is imported in
the children, so a rank starts without pytest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from forward_helpers import forward_batch

from rollout.forward.all_reduce_norm import AllReduceNorm
from rollout.forward.forward_batch import ForwardBatch, ForwardMode
from rollout.forward.kv_pool import KVPool, ReqToTokenPool
from rollout.forward.tensor_parallel import SINGLE, TPGroup
from rollout.models.loader import load_model

MAX_LEN = 128  # KV slots per request
PROMPT_LENS = (5, 37, 20)
DECODE_STEPS = 3


class Cache:
    """KV pool sized by the model's per-rank KV heads; request i owns slots 1 + MAX_LEN * i..."""

    def __init__(self, model: torch.nn.Module, num_reqs: int, device: str = "cpu") -> None:
        config, self.device = model.config, device
        self.kv = KVPool(
            config.num_hidden_layers,
            num_reqs * MAX_LEN,
            model.num_local_kv_heads,
            model.head_dim,
            torch.float32,
            device,
        )
        self.table = ReqToTokenPool(num_reqs, MAX_LEN, device)
        for i in range(num_reqs):
            slots = torch.arange(1 + i * MAX_LEN, 1 + (i + 1) * MAX_LEN, device=device)
            self.table.write(i, 0, slots)


def step(
    model, cache: Cache, seqs: list[list[int]], cached: list[int], mode, backend=None,
    prepare: Callable[[ForwardBatch], None] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Logits of seqs[i][cached[i]:] on top of KV holding seqs[i][:cached[i]]; `prepare(fb)`
    runs before the forward (LoRA's adapter rows)."""
    fb = forward_batch(cache.kv, cache.table, seqs, cached, mode, backend, cache.device)
    if prepare is not None:
        prepare(fb)
    with torch.no_grad():
        return model.compute_logits(model(fb.input_ids, fb.positions, fb))


def prefill_and_decode(
    model, vocab: int, device: str = "cpu", backend=None,
    prepare: Callable[[ForwardBatch], None] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Logits of a ragged prefill then DECODE_STEPS decode steps, stacked: [rows, vocab]."""
    gen = torch.Generator().manual_seed(0)
    lens = [n + DECODE_STEPS for n in PROMPT_LENS]
    full = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
    cache = Cache(model, len(full), device)
    prompts = [s[:n] for s, n in zip(full, PROMPT_LENS)]
    out = [step(model, cache, prompts, [0] * len(full), ForwardMode.EXTEND, backend, prepare)]
    for i in range(1, DECODE_STEPS + 1):
        seqs = [s[: n + i] for s, n in zip(full, PROMPT_LENS)]
        cached = [len(s) - 1 for s in seqs]
        out.append(step(model, cache, seqs, cached, ForwardMode.DECODE, backend, prepare))
    return torch.cat(out)


def perturb(ref, model, scale: float) -> None:
    """Moves every weight of both models by the same seeded noise: the whole model takes full
    tensors; the shard takes every other name full and the rest pre-sliced to its shard."""
    for i, name in enumerate(sorted(ref.hf_param_shapes())):
        gen = torch.Generator().manual_seed(1000 + i)
        old = ref.hf_weight(name)
        full = old + scale * torch.randn(old.shape, generator=gen).to(old.device, old.dtype)
        ref.load_weights([(name, full)])
        shard = model.hf_shard(name)
        if i % 2 or shard is None:
            model.load_weights([(name, full)])
        else:
            model.load_weights([(name, shard.take(full).clone())], presharded=True)


def run_case(case: dict[str, Any], tp: TPGroup) -> dict[str, Any]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(case["path"])
    for key, value in case.get("overrides", {}).items():
        setattr(config, key, value)
    fmt = case.get("load_format", "auto")
    ref = load_model(case["path"], config, torch.float32, "cpu", fmt, tp=SINGLE)
    model = load_model(case["path"], config, torch.float32, "cpu", fmt, tp=tp)
    if case.get("perturb"):
        perturb(ref, model, case["perturb"])
    want = prefill_and_decode(ref, config.vocab_size)
    got = prefill_and_decode(model, config.vocab_size)
    result = {
        "shape": list(got.shape),
        "want_shape": list(want.shape),
        "err": (got - want).abs().max().item(),
        "scale": want.abs().max().item(),
        "local_heads": model.num_local_heads,
        "local_kv_heads": model.num_local_kv_heads,
    }
    if case.get("defer_all_reduces"):
        # The same shard again, its all-reduces done by the norms after them (unfused here).
        model.model.defer_all_reduces(AllReduceNorm(tp))
        deferred = prefill_and_decode(model, config.vocab_size)
        result["deferred_diff"] = (deferred - got).abs().max().item()
        norms = [m for m in model.modules() if getattr(m, "all_reduce", None) is not None]
        result["summing_norms"] = len(norms)
        result["layers"] = config.num_hidden_layers
    return result


def run_rank(
    rank: int, world: int, init_file: str, out_dir: str, cases: dict,
    run: Callable[[dict[str, Any], TPGroup], dict[str, Any]] = run_case,
) -> None:  # fmt: skip
    """Entry point of one spawned rank (torch.multiprocessing passes `rank` first): `run` of
    each case (a function of an importable module: it travels to the rank by name)."""
    torch.set_num_threads(1)  # the ranks share a few cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        tp = TPGroup.from_group()
        results = {name: run(case, tp) for name, case in cases.items()}
        # No rank tears its connections down while another may still be reading from them.
        dist.barrier()
        # Written before the teardown: gloo's teardown has aborted a rank (SIGABRT, "terminate
        # called without an active exception") once after every result was in.
        path = os.path.join(out_dir, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)  # whole or absent
    finally:
        dist.destroy_process_group()
