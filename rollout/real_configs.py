"""Configs of real models (public dimensions), for benchmarks with random weights."""

from __future__ import annotations

import json
import os
from typing import Any

_COMMON: dict[str, Any] = {"hidden_act": "silu", "torch_dtype": "bfloat16", "initializer_range": 0.02}

REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "qwen2.5-7b": {
        **_COMMON,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "llama-3.1-8b": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
}


def write_config_checkpoint(name: str, path: str) -> str:
    """Writes config.json of a real model plus the local tiny tokenizer (no weights: load it
    with load_format="dummy"). Returns the path."""
    from rollout.tiny_model import write_tokenizer

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(REAL_CONFIGS[name], f, indent=2)
    write_tokenizer(path)
    return path
