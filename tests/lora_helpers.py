"""Helpers of the LoRA tests: PEFT adapters made on the fly, and a forward of our model over a
ragged batch whose requests each name their adapter."""

from __future__ import annotations

import torch
from forward_helpers import forward_batch
from transformers import AutoModelForCausalLM

from rollout.forward.forward_batch import ForwardMode
from rollout.forward.kv_pool import KVPool, ReqToTokenPool
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
    fb = forward_batch(cache.kv, cache.table, seqs, cached, mode)
    slots.prepare_batch(adapters, fb.extend_lens_cpu)
    with torch.no_grad():
        return list(model.compute_logits(model(fb.input_ids, fb.positions, fb)).split(fb.extend_lens_cpu))
