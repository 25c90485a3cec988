"""Helpers of the LoRA tests: PEFT adapters made on the fly, and a forward of our model over a
ragged batch whose requests each name their adapter."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.forward.attention import create_attention_backend
from rollout.forward.forward_batch import ForwardBatch, ForwardMode
from rollout.forward.kv_pool import KVPool, ReqToTokenPool
from rollout.models import layers
from rollout.models.llama import head_dim_of, num_kv_heads_of

MAX_LEN = 64  # KV slots per request


def make_peft_adapter(base: str, out: str, r: int, alpha: float, targets, seed: int, **kw) -> str:
    """Saves a PEFT LoRA adapter of `base` with random A and B (B is zero by default: that
    would change nothing) to directory `out`; returns it."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **kw
    )
    torch.manual_seed(seed)
    get_peft_model(model, config).save_pretrained(out)
    return out


def peft_model(base: str, adapter: str | None):
    """transformers' model of `base`, with PEFT's `adapter` applied when one is given."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


class Cache:
    """A KV pool where request i owns slots 1 + MAX_LEN * i onwards."""

    def __init__(self, config, num_reqs: int) -> None:
        self.kv = KVPool(
            config.num_hidden_layers,
            num_reqs * MAX_LEN + 1,
            num_kv_heads_of(config),
            head_dim_of(config),
            torch.float32,
            "cpu",
        )
        self.table = ReqToTokenPool(num_reqs, MAX_LEN, "cpu")
        for i in range(num_reqs):
            self.table.write(i, 0, torch.arange(1 + i * MAX_LEN, 1 + (i + 1) * MAX_LEN))


def run(model, slots, cache, seqs, cached, adapters, mode=ForwardMode.EXTEND) -> list[torch.Tensor]:
    """One forward of seqs[i][cached[i]:] over KV holding seqs[i][:cached[i]], request i on
    adapter adapters[i] (None: base). Returns each request's logits of its new tokens."""
    ids, pos, loc = [], [], []
    for i, (seq, c) in enumerate(zip(seqs, cached)):
        ids += seq[c:]
        pos += range(c, len(seq))
        loc += cache.table.read(i, c, len(seq)).tolist()
    seq_lens = [len(s) for s in seqs]
    extend = [len(s) - c for s, c in zip(seqs, cached)]
    fb = ForwardBatch(
        mode=mode,
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        out_cache_loc=torch.tensor(loc),
        req_pool_indices=torch.arange(len(seqs)),
        seq_lens=torch.tensor(seq_lens),
        extend_lens=torch.tensor(extend),
        req_to_token=cache.table.table,
        kv_pool=cache.kv,
        attn_backend=create_attention_backend("torch"),
        seq_lens_cpu=seq_lens,
        extend_lens_cpu=extend,
    )
    fb.attn_backend.prepare(fb)
    slots.prepare_batch(adapters, extend)
    with torch.no_grad():
        return list(model.compute_logits(model(fb.input_ids, fb.positions, fb)).split(extend))


def _merged_forward(self, x: torch.Tensor) -> torch.Tensor:
    out = layers.linear(x, self.weight, self.bias, self.skinny_rows)
    if getattr(self, "lora", None) is not None:
        self.lora.apply(x, out)
    return out


def _row_parallel_forward(self, x: torch.Tensor) -> torch.Tensor:
    bias = self.bias if self.tp.rank == 0 else None
    out = layers.linear(x, self.weight, bias, self.skinny_rows)
    if getattr(self, "lora", None) is not None:
        self.lora.apply(x, out)
    return self.tp.all_reduce(out)


@contextlib.contextmanager
def lora_wiring() -> Iterator[None]:
    """The wiring rollout.models.lora documents, patched into the layers while
    rollout.models.layers lacks it (a Linear there then has no `lora` attribute)."""
    if hasattr(layers.Linear, "lora"):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers.MergedLinear, "forward", _merged_forward)
        patch.setattr(layers.RowParallelLinear, "forward", _row_parallel_forward)
        yield
