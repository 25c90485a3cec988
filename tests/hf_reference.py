"""transformers forwards in float32, the reference the embedding and scoring tests compare to.
Models load once per checkpoint and stay for the session."""

from __future__ import annotations

from functools import cache

import torch


@cache
def tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def hf_scores(path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = _hf(path, AutoModelForSequenceClassification)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def hf_last_hidden(path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        out = _hf(path, AutoModelForCausalLM)(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0, -1]


def hf_next_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return torch.log_softmax(_hf(path, AutoModelForCausalLM)(torch.tensor([ids])).logits[0, -1], -1)


@cache
def _hf(path: str, cls):
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, exactly new_tokens long (EOS ignored)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return greedy_of(hf, prompts, new_tokens)


def greedy_of(hf, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """`hf`'s (a transformers or PEFT model's) greedy continuation of each prompt."""
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(
                input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            outs.append(out[0, len(ids) :].tolist())
    return outs
