"""PoolingHead: the embeddings of embed requests, from the hidden states of their last tokens.

An embedding model's output is the final-norm hidden state itself; a classifier's is its
scores. Either is normalized per request when the request asks.
"""

from __future__ import annotations

import torch

from rollout.engine.req import Req


class PoolingHead:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def pool(self, reqs: list[Req], pooled: torch.Tensor) -> torch.Tensor:
        """pooled: [P, hidden] hidden states of the last tokens of `reqs`, one row each.
        Returns [P, D] float32 on the device: the hidden states, or a classifier's scores."""
        if hasattr(self.model, "compute_scores"):
            pooled = self.model.compute_scores(pooled)  # [P, num_labels]
        pooled = pooled.float()
        if not any(r.req.normalize for r in reqs):
            return pooled
        normalize = torch.nn.functional.normalize
        rows = [normalize(v, dim=-1) if r.req.normalize else v for v, r in zip(pooled, reqs)]
        return torch.stack(rows)
