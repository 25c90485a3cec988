"""Small random checkpoints with a locally trained tokenizer, for tests and demos (no model hub).

`make_tiny_model(path, arch)` writes config.json, model.safetensors (or shards with an index),
generation_config.json and a byte-level BPE tokenizer with a ChatML template, all loadable by
transformers' AutoModelForCausalLM and AutoTokenizer.
"""

from __future__ import annotations

import json
import os
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS_TOKEN = "<|im_end|>"  # the end of a chat turn, as in Qwen's instruct models
PAD_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 1024  # an upper bound: the trainer stops once the corpus has no pair left to merge

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2's split (digits one by one, words with their leading space): transformers gives qwen2
# checkpoints this pre-tokenizer whatever tokenizer.json says, so every arch uses it.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
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
A language model predicts the next token from the tokens before it.

In winter the river froze, and the farmers walked across the ice to the market on the
other side. They carried apples, cheese, honey and warm wool. The old clockmaker fixed
watches for everyone; he said that time is patient with those who listen. His daughter
painted the houses in bright colours: red, orange, yellow, green, blue and purple.

Question: If a train leaves at 9 and arrives at 11, how long is the journey? Answer: two
hours. Question: Tom has 5 marbles and finds 8 more. How many does he have? Answer: 13.
Let x be a number such that x + 7 = 19; then x = 12. Divide 100 by 4 to get 25, and
multiply 25 by 3 to get 75. Check your work step by step before you write the result.

Scientists observe the stars through large telescopes high in the mountains. Light from
distant galaxies travels for millions of years before it reaches our planet. Water boils
at 100 degrees and freezes at 0 degrees. Plants need sunlight, water and air to grow.
The computer reads a file, sorts the list, and prints each value on its own line:
def add(a, b): return a + b # simple function
Numbers 0123456789, punctuation .,;:!?'"()[]{}<>-+=*/%&#@$_~^|\\ and new lines
are all part of text. The end.
"""

_ARCH = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": False,
        # Llama 3.1's scaling, with an original length short enough to matter at test lengths.
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "tie_word_embeddings": False,
        "head_dim": 32,  # != hidden_size / heads = 16, as in the real Qwen3 models
    },
}


def write_tokenizer(path: str) -> None:
    """Trains a byte-level BPE on the built-in corpus (deterministic) and saves it to `path`
    with its config and chat template: 882 tokens, the special ones at ids 0, 1, 2."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.split("\n\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(path)


def make_tiny_model(
    path: str,
    arch: str = "qwen3",
    seed: int = 0,
    max_shard_size: str | None = None,
    num_labels: int | None = None,
    **overrides: Any,
) -> str:
    """Writes a random float32 checkpoint of `arch` (llama, qwen2, qwen3) to `path`; returns
    `path`. Same seed, same bytes. `max_shard_size` (e.g. "100KB") writes shards plus
    model.safetensors.index.json; `overrides` replace config.json fields. With `num_labels`,
    a sequence classifier (`<Arch>ForSequenceClassification`, a reward model when 1) instead
    of a causal LM."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )
    from transformers.utils import logging as hf_logging

    if arch not in _ARCH:
        raise ValueError(f"arch must be one of {', '.join(_ARCH)}, got {arch!r}")
    if num_labels is not None and num_labels < 1:
        raise ValueError(f"num_labels must be >= 1, got {num_labels}")
    os.makedirs(path, exist_ok=True)
    write_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
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
        # Far above the usual 0.02: random logits then vary enough that greedy decoding
        # does not repeat one token forever.
        "initializer_range": 0.15,
        "bos_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        "eos_token_id": eos,
        "pad_token_id": tokenizer.pad_token_id,
        "torch_dtype": "float32",
        **overrides,
    }
    if num_labels is not None:
        causal = cfg["architectures"][0]
        cfg["architectures"] = [causal.replace("ForCausalLM", "ForSequenceClassification")]
        cfg["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
        cfg["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    auto = AutoModelForCausalLM if num_labels is None else AutoModelForSequenceClassification
    model = auto.from_config(config, dtype=torch.float32)
    if num_labels is None:  # classifiers don't generate: they have no generation config
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    # Quiet while saving: tests make many of these. The caller's setting comes back after.
    bars_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path, safe_serialization=True, **kwargs)
    finally:
        if bars_on:
            hf_logging.enable_progress_bar()
    return path
