"""Options of the HTTP server (the engine's own options live in rollout/config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.option_field import option as _opt
from rollout.parsers import check_parser_names


@dataclass(frozen=True)
class ServerOptions:
    host: str = _opt("127.0.0.1", "address to bind; 0.0.0.0 exposes the server to the network")
    port: int = _opt(30000, "TCP port to listen on")
    api_key: str | None = _opt(
        None, "if set, every endpoint but /health needs 'Authorization: Bearer KEY'"
    )
    admin_api_key: str | None = _opt(
        None, "if set, admin endpoints (flush, abort_all, weights, memory) need this key instead"
    )
    served_model_name: str | None = _opt(None, "model id in the OpenAI API; defaults to model_path")
    max_request_bytes: int = _opt(64 * 2**20, "largest request body accepted, in bytes")
    allowed_weight_roots: tuple[str, ...] = _opt(
        (),
        "directories under which /update_weights_from_disk may load checkpoints (repeatable); "
        "every file it reads must resolve there, symlinks followed",
    )
    log_level: str = _opt("warning", "uvicorn log level: critical, error, warning, info, debug")
    tool_call_parser: str | None = _opt(
        None,
        "how the model writes tool calls, to return them as OpenAI tool_calls: hermes, llama3, "
        "mistral, qwen, qwen25 (unset: chat output is returned as text)",
    )
    reasoning_parser: str | None = _opt(
        None, "reasoning tags to split into reasoning_content: deepseek-r1, qwen3, qwen3-thinking"
    )
    dp_size: int = _opt(
        1,
        "engine replicas on this node behind one prefix-aware router, each on its own GPUs (or a "
        "share of one when there are fewer); weight and memory calls reach all of them, all or "
        "nothing (needs the ray extra)",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        check_parser_names(self.tool_call_parser, self.reasoning_parser)
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(
                f"log_level must be one of critical, error, warning, info, debug, got {self.log_level!r}"
            )
