"""`rollout serve`: the CLI (generated from the option dataclasses), starting and stopping.

On SIGTERM or SIGINT every in-flight request is aborted first (its client gets finish_reason
abort), then uvicorn closes the connections and the port, then the engine's subprocesses stop;
the exit status is 0. If the engine dies the server stops too, with exit status 1 (see
lifecycle.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
import sys
from typing import Any

import uvicorn

from rollout.config import EngineOptions, check_model_path, option_fields
from rollout.engine.heap import startup_heap_frozen
from rollout.server.lifecycle import (
    EXIT_ENGINE_DIED,
    EngineServer,
    ShutdownSignals,
    StartInterrupted,
    serve_on_loop,
    server_loop,
)
from rollout.server.options import ServerOptions

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
            help_text = f"{help_text} (default: none)"
            parser.add_argument(flag, action="append", default=None, help=help_text)
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


def listen(host: str, port: int, prog: str = "rollout serve") -> socket.socket:
    """The server's socket, bound before anything slow starts: a port in use fails at once,
    naming itself, rather than after the model has loaded. uvicorn listens on it when it
    starts serving (until then a connection is refused, as before it binds)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(
            f"{prog}: cannot listen on {host}:{port}: {e.strerror or e}; choose another --port "
            f"(or --host), or stop what holds it"
        ) from None
    return sock


def serve(options: ServerOptions, engine_options: dict[str, Any]) -> int:
    """Runs the server until a shutdown signal (returns 0) or the engine's death (returns 1)."""
    with ShutdownSignals() as signals:
        try:
            return _serve(options, engine_options, signals)
        except StartInterrupted:
            return 0  # what had started was shut down on the way out


def _serve(options: ServerOptions, engine_options: dict[str, Any], signals: ShutdownSignals) -> int:
    from rollout.engine.engine import RolloutEngine
    from rollout.server.app import create_app

    with listen(options.host, options.port) as sock:
        engine = RolloutEngine(**engine_options, loop_factory=server_loop)  # serve_on_loop's
        try:
            app = create_app(engine, options)
            config = uvicorn.Config(
                app,
                host=options.host,
                port=options.port,
                log_level=options.log_level,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            )
            server = signals.server = EngineServer(config, engine, app.state)
            url = f"http://{options.host}:{options.port}"
            model = engine.options.model.model_path
            print(f"rollout: serving {model} on {url}", file=sys.stderr, flush=True)
            with startup_heap_frozen():  # torch, transformers, the app: the event loop's too
                serve_on_loop(server, engine, sock)
        finally:
            engine.shutdown()
    return EXIT_ENGINE_DIED if server.engine_died else 0


def parse(argv: list[str] | None = None, prog: str = "rollout serve") -> tuple[ServerOptions, dict[str, Any]]:
    """The server's and the engine's options from the command line (exits on a bad one)."""
    args = build_parser(prog).parse_args(argv)
    try:
        options, engine = split_args(args)
        # The engine's own checks, before anything starts: a bad value is this one line, not a
        # traceback from the engine's constructor.
        EngineOptions.from_kwargs(**engine)
        check_model_path(engine["model_path"])
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise SystemExit(f"{prog}: error: {e}") from e
    return options, engine
