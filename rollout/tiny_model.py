"""Small random checkpoints with a locally trained tokenizer, for tests and demos (no model hub).

`make_tiny_model(path, arch)` writes config.json, model.safetensors, generation_config.json
and a byte-level BPE tokenizer with a ChatML template, all loadable by transformers'
AutoModelForCausalLM and AutoTokenizer.
"""

from __future__ import annotations

import json
import os
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 1024  # at most; the small corpus yields about 600 tokens

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. Once upon a time there was a small village
by the sea, where the people fished and sang and told stories of ships that sailed beyond
the edge of the world. Every morning the baker opened her shop and the smell of bread
filled the street. Children ran to school, counting numbers: one, two, three, four, five,
six, seven, eight, nine, ten. What is the answer? The answer is 42. Please add 3 and 4.
The sum of 12 and 30 is 42; the product of 6 and 7 is 42 too. Hello there! How are you
today? I am fine, thank you. Reinforcement learning trains a policy from rewards: the
model writes an answer, a reward says how good it was, and the weights move a little.
A language model predicts the next token from the tokens before it. Numbers 0123456789,
punctuation .,;:!?'"()[]{}<>-+=*/%&#@$ and new lines
are all part of text. The end.
"""

_ARCH = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    },
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "tie_word_embeddings": False,
        "head_dim": 32,
    },
}


def write_tokenizer(path: str) -> None:
    """Trains a byte-level BPE (deterministic) and saves it with its config and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(path)


def make_tiny_model(path: str, arch: str = "qwen3", seed: int = 0, **overrides: Any) -> str:
    """Writes a random checkpoint of `arch` (llama, qwen2, qwen3) to `path` and returns it.
    `max_shard_size` (e.g. "100KB") writes a sharded checkpoint; other overrides go to the config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if arch not in _ARCH:
        raise ValueError(f"arch must be one of {', '.join(_ARCH)}, got {arch!r}")
    max_shard_size = overrides.pop("max_shard_size", None)
    os.makedirs(path, exist_ok=True)
    write_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = {
        **_ARCH[arch],
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "initializer_range": 0.15,
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": eos,
        "pad_token_id": tokenizer.pad_token_id,
        "torch_dtype": "float32",
        **overrides,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path
