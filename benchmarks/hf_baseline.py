"""transformers `generate` on the same random-weight model and prompts, for `--compare hf`.

Runs in the benchmark's own process after the engine has shut down (its GPU memory is back).
"""

from __future__ import annotations

import time

import torch


def load_hf_model(model_path: str, dtype: str = "bfloat16"):
    """The checkpoint's architecture with random weights (speed does not depend on them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    torch_dtype = getattr(torch, dtype) if dtype != "auto" else torch.bfloat16
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch_dtype, attn_implementation="sdpa"
        )
    return model.eval()


@torch.no_grad()
def hf_generate_seconds(
    model, prompts: list[list[int]], new_tokens: list[int], params: list[dict]
) -> float:
    """Seconds for `model.generate` over `prompts` in one left-padded batch, each row made to
    run to the longest of `new_tokens` (static batching: rows that asked for fewer still wait)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    temperature = params[0].get("temperature", 1.0)
    sample = temperature > 0
    extra = {"temperature": temperature, "top_k": 0, "top_p": 1.0} if sample else {}
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(
        ids.cuda(),
        attention_mask=mask.cuda(),
        max_new_tokens=max(new_tokens),
        min_new_tokens=max(new_tokens),
        do_sample=sample,
        eos_token_id=None,
        pad_token_id=0,
        **extra,
    )
    torch.cuda.synchronize()
    return time.perf_counter() - start


def hf_throughput(
    model_path: str, prompts: list[list[int]], params: list[dict], batch_size: int, dtype: str
) -> dict:
    """Output tokens per second of transformers over the workload, in batches of `batch_size`;
    only the tokens each request asked for count."""
    model = load_hf_model(model_path, dtype)
    hf_generate_seconds(model, prompts[:1], [4], params[:1])  # warm-up
    seconds, tokens = 0.0, 0
    for i in range(0, len(prompts), batch_size):
        chunk = slice(i, i + batch_size)
        new = [p["max_new_tokens"] for p in params[chunk]]
        seconds += hf_generate_seconds(model, prompts[chunk], new, params[chunk])
        tokens += sum(new)
    del model
    torch.cuda.empty_cache()
    return {"hf_seconds": round(seconds, 3), "hf_output_tok_per_s": round(tokens / seconds, 1)}
