"""Model architectures, by the name in a checkpoint's config.json `architectures`."""

from __future__ import annotations

from typing import Any

from rollout.models.llama import LlamaForCausalLM
from rollout.models.qwen2 import Qwen2ForCausalLM
from rollout.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(hf_config: Any) -> type:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported architecture {archs}; supported: {', '.join(MODEL_REGISTRY)}")
