"""Sequence classifiers (reward models): a decoder body whose last token's final-norm hidden
state goes through a `score` head, Linear(hidden, num_labels, bias=False), as in transformers'
`*ForSequenceClassification`. Served with `is_embedding=True`; they have no language-model head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rollout.forward.tensor_parallel import SINGLE, TPGroup
from rollout.models.llama import LlamaForCausalLM
from rollout.models.weight_map import map_hf_names


class LlamaForSequenceClassification(LlamaForCausalLM):
    has_lm_head = False

    def __init__(self, config: Any, tp: TPGroup = SINGLE) -> None:
        super().__init__(config, tp)
        self.num_labels = int(config.num_labels)
        # Whole on every rank: the hidden states it reads are the same on all of them.
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self._hf_targets = map_hf_names(self)  # now with score.weight

    def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (final-norm states of each sequence's last token) ->
        [N, num_labels] float32."""
        return self.score(hidden).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TypeError(
            f"{type(self).__name__} has a score head and no language-model head: it classifies "
            "(encode/classify), it cannot generate or score label tokens"
        )


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    qkv_bias = True


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    qk_norm = True
