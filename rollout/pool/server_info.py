"""The pool's get_server_info: the replicas' own, summed where a sum means something, with
each replica's state, info and routing counters under "replicas"."""

from __future__ import annotations

from typing import Any

# Counts and sizes that add up over replicas; every other key is replica 0's (the model, the
# options), but for the pool's own (weight_version, weight_updates, generation_paused).
SUMMED = (
    "num_running", "num_waiting", "max_total_tokens", "kv_total", "kv_free", "kv_cached",
    "kv_evictable", "kv_stale", "kv_in_requests", "prompt_tokens", "cached_tokens",
    "generated_tokens", "retractions", "kv_cache_bytes", "weight_update_staged",
    "pipeline_drains", "device_busy_s", "open_sessions", "sessions_with_pinned_kv",
    "kv_pinned_by_sessions",
)  # fmt: skip


def merge_info(
    infos: list[dict | None], states: list[dict], routing: list[dict], pool: dict[str, Any]
) -> dict:
    """infos[i] is replica i's get_server_info() (None: it did not answer)."""
    answered = [info for info in infos if info is not None]
    base = dict(answered[0]) if answered else {}
    for key in SUMMED:
        values = [info[key] for info in answered if isinstance(info.get(key), (int, float))]
        if values:
            base[key] = sum(values)
    base["kv_whole"] = all(info.get("kv_whole", True) for info in answered)
    serving = [
        info for info, s in zip(infos, states) if info is not None and s["state"] == "serving"
    ]
    base.update(_adapter_versions(serving))
    base.pop("ranks", None)
    base["replicas"] = [
        {**state, "routing": route, "info": info}
        for state, route, info in zip(states, routing, infos)
    ]
    return {**base, **pool}


def _adapter_versions(infos: list[dict]) -> dict[str, Any]:
    """lora_weight_versions: each adapter's label where every serving replica reports the same
    one; an adapter they disagree on (only while one is being brought up to date) is left out
    of it and listed, one label per serving replica, under lora_weight_versions_differ."""
    reported = [info["lora_weight_versions"] for info in infos if "lora_weight_versions" in info]
    if not reported:
        return {}
    names = {name for versions in reported for name in versions}
    agreed, differ = {}, {}
    for name in sorted(names):
        labels = [versions.get(name) for versions in reported]
        if len(set(labels)) == 1:
            agreed[name] = labels[0]
        else:
            differ[name] = labels
    return {
        "lora_weight_versions": agreed,
        **({"lora_weight_versions_differ": differ} if differ else {}),
    }
