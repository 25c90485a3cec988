"""GET /v1/loads: SGLang's load report, from the server info of each data-parallel rank."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from rollout import __version__


def loads_report(ranks: list[dict[str, Any] | None], dp_rank: int | None = None) -> dict[str, Any]:
    """`ranks`: the server info of each rank (an engine's own, or each replica's of a pool; None
    for a replica that is down), in rank order. One entry per rank that answers (only
    `dp_rank`'s, where given) and their aggregate."""
    loads = [
        _load(info, i) for i, info in enumerate(ranks) if info is not None and dp_rank in (None, i)
    ]
    n = max(len(loads), 1)
    running = sum(d["num_running_reqs"] for d in loads)
    waiting = sum(d["num_waiting_reqs"] for d in loads)
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": __version__,
        "dp_rank_count": len(loads),
        "loads": loads,
        "aggregate": {
            "total_running_reqs": running,
            "total_waiting_reqs": waiting,
            "total_reqs": running + waiting,
            "avg_token_usage": round(sum(d["token_usage"] for d in loads) / n, 4),
        },
    }


def _load(info: dict[str, Any], dp_rank: int) -> dict[str, Any]:
    """Token usage counts the KV slots held by requests and by the prefix cache alike;
    cache_hit_rate is the share of prompt tokens served from the cache since start."""
    used = int(info["kv_total"]) - int(info["kv_free"])
    running, waiting = int(info["num_running"]), int(info["num_waiting"])
    prompt = int(info.get("prompt_tokens", 0))
    return {
        "dp_rank": dp_rank,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": used,
        "max_total_num_tokens": int(info["max_total_tokens"]),
        "token_usage": round(used / max(int(info["kv_total"]), 1), 4),
        "cache_hit_rate": round(int(info.get("cached_tokens", 0)) / prompt, 4) if prompt else 0.0,
        "generated_tokens": int(info.get("generated_tokens", 0)),
        "weight_version": info.get("weight_version"),
    }
