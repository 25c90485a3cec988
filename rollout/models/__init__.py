"""Model architectures, by the name in a checkpoint's config.json `architectures`."""

from __future__ import annotations

from typing import Any

from torch import nn

from rollout.models.classifiers import (
    LlamaForSequenceClassification,
    Qwen2ForSequenceClassification,
    Qwen3ForSequenceClassification,
)
from rollout.models.llama import LlamaForCausalLM
from rollout.models.qwen2 import Qwen2ForCausalLM
from rollout.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": Qwen2ForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
}


def is_classifier_architecture(hf_config: Any) -> bool:
    """Does the checkpoint's first supported architecture carry a score head (a reward model)?"""
    return get_model_class(hf_config).__name__.endswith("ForSequenceClassification")


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The class for the first of `hf_config.architectures` that this engine implements."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported architecture {archs}; supported: {', '.join(MODEL_REGISTRY)}")


__all__ = ["MODEL_REGISTRY", "get_model_class", "is_classifier_architecture"]
