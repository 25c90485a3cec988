"""`rollout serve`: the CLI (generated from the option dataclasses) and the server's lifecycle.

On SIGTERM or SIGINT every in-flight request is aborted first (its client gets finish_reason
abort), then uvicorn closes the connections and the port, then the engine's subprocesses stop.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import threading
from typing import Any

import uvicorn

from rollout.config import option_fields
from rollout.server.options import ServerOptions

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


def add_option_arguments(parser: argparse.ArgumentParser, fields: list[dataclasses.Field]) -> None:
    """One --flag per dataclass field, typed from its annotation, help from its metadata."""
    for f in fields:
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        kind = str(f.type)
        default = f.default
        if kind == "bool":
            parser.add_argument(flag, action="store_true", default=default, help=help_text)
        elif kind.startswith("tuple"):
            parser.add_argument(flag, action="append", default=None, help=f"{help_text} (default: none)")
        else:
            convert = int if kind.startswith("int") else float if kind.startswith("float") else str
            required = f.name == "model_path"
            parser.add_argument(
                flag,
                type=convert,
                default=None if required else default,
                required=required,
                help=f"{help_text} (default: %(default)s)" if not required else help_text,
            )


def build_parser(prog: str = "rollout serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model over HTTP: SGLang-native and OpenAI-compatible endpoints.",
    )
    add_option_arguments(parser, dataclasses.fields(ServerOptions))
    add_option_arguments(parser, option_fields())
    return parser


def split_args(args: argparse.Namespace) -> tuple[ServerOptions, dict[str, Any]]:
    values = vars(args)
    server = {f.name: values[f.name] for f in dataclasses.fields(ServerOptions)}
    server["allowed_weight_roots"] = tuple(server["allowed_weight_roots"] or ())
    engine = {f.name: values[f.name] for f in option_fields()}
    return ServerOptions(**server), engine


def serve(options: ServerOptions, engine_options: dict[str, Any]) -> None:
    from rollout.engine.engine import RolloutEngine
    from rollout.server.app import create_app

    engine = RolloutEngine(**engine_options)
    try:
        app = create_app(engine, options)
        config = uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            log_level=options.log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = _Server(config, engine)
        print(f"rollout: serving {engine.options.model.model_path} on http://{options.host}:{options.port}",
              file=sys.stderr, flush=True)
        server.run()
    finally:
        engine.shutdown()


class _Server(uvicorn.Server):
    """uvicorn's server, aborting the engine's requests as soon as a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, engine: Any) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            threading.Thread(target=_abort_all, args=(self.engine,), daemon=True).start()
        super().handle_exit(sig, frame)


def _abort_all(engine: Any) -> None:
    try:
        engine.abort_request(abort_all=True)
    except Exception:  # noqa: BLE001 - shutting down regardless
        logger.exception("aborting requests at shutdown failed")


def main(argv: list[str] | None = None, prog: str = "rollout serve") -> None:
    args = build_parser(prog).parse_args(argv)
    try:
        options, engine_options = split_args(args)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"{prog}: error: {e}") from e
    serve(options, engine_options)
