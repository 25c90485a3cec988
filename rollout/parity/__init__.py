"""Trainer parity: a trainer-side forward that runs the engine's batch-invariant kernels, so
the logprobs it computes equal bit for bit those of an engine with deterministic inference."""

from __future__ import annotations

from rollout.parity.model import ParityModel

__all__ = ["ParityModel"]
