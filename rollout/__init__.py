"""rollout: an LLM inference engine built for reinforcement learning from feedback."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["RolloutEngine", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import rollout` must not pull in torch and the engine.
    if name == "RolloutEngine":
        from rollout.engine.engine import RolloutEngine

        return RolloutEngine
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
