"""`rollout router --worker-urls URL ...`: one HTTP front for several `rollout serve` workers.

The front is `rollout serve`'s own app (rollout/server/app.py: the SGLang-native and OpenAI
routes, API keys, metrics, shutdown) over a RolloutPool of the workers instead of one engine:
requests are routed by prefix affinity and load (router.py), admin calls (weights, versions,
pause, memory, flush) fan out to every worker, all or nothing (weights.py), a worker that dies
is routed around (its requests retried once elsewhere) and taken back, with the pool's
weights, once its supervisor has restarted it and its /health answers.

The router reads the tokenizer (for the OpenAI routes and request checks) from --model-path,
by default the workers' model path. It talks to the workers with --worker-api-key (their
admin key, if they have one); its own clients authenticate with --api-key / --admin-api-key
as `rollout serve`'s do.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
import sys
from typing import Any

import uvicorn

from rollout.pool.pool_setup import PoolOptions
from rollout.server.launch import GRACEFUL_SHUTDOWN_S, add_option_arguments, listen
from rollout.server.lifecycle import (
    EXIT_ENGINE_DIED,
    EngineServer,
    ShutdownSignals,
    StartInterrupted,
    serve_on_loop,
    server_loop,
)
from rollout.server.options import ServerOptions

POOL_FLAGS = {
    "prefix_block_size": "tokens per block of the prefix index (router.py)",
    "max_imbalance_tokens": "a prefix match is ignored when its worker has this many more "
    "outstanding tokens than the least loaded one",
    "health_check_s": "seconds between health checks of the workers (0: none)",
    "wait_for_replica_s": "how long a request waits for a worker while none serves",
}


def _server_fields() -> list[dataclasses.Field]:
    """rollout serve's server flags but --dp-size (the router's replicas are its --worker-urls)."""
    return [f for f in dataclasses.fields(ServerOptions) if f.name != "dp_size"]


def build_parser(prog: str = "rollout router") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Route SGLang-native and OpenAI requests over several rollout serve "
        "workers, with prefix affinity; fan admin calls out to all of them, all or nothing.",
    )
    parser.add_argument("--worker-urls", nargs="+", required=True, help="the workers' base URLs")
    parser.add_argument("--worker-api-key", help="the key the router sends to the workers")
    parser.add_argument("--model-path", help="where the tokenizer is read; default: the workers'")
    add_option_arguments(parser, _server_fields())
    defaults = PoolOptions()
    for name, help_text in POOL_FLAGS.items():
        value = getattr(defaults, name)
        parser.add_argument(
            "--" + name.replace("_", "-"), type=type(value), default=value,
            help=f"{help_text} (default: %(default)s)",
        )  # fmt: skip
    return parser


def main(argv: list[str] | None = None, prog: str = "rollout router") -> int:
    """Runs the router until a shutdown signal (0); 1 if every worker was given up."""
    args = build_parser(prog).parse_args(argv)
    values = vars(args)
    try:
        server_values = {f.name: values[f.name] for f in _server_fields()}
        server_values["allowed_weight_roots"] = tuple(server_values["allowed_weight_roots"] or ())
        options = ServerOptions(**server_values)
        pool_options = PoolOptions(**{name: values[name] for name in POOL_FLAGS})
        from rollout.pool.http_replica import check_worker_urls

        check_worker_urls(args.worker_urls)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"{prog}: error: {e}") from e
    with ShutdownSignals() as signals:
        try:
            return _serve(args, options, pool_options, signals)
        except StartInterrupted:
            return 0


def _serve(
    args: argparse.Namespace, options: ServerOptions, pool_options: PoolOptions,
    signals: ShutdownSignals,
) -> int:  # fmt: skip
    from rollout.pool.pool import RolloutPool

    with listen(options.host, options.port, "rollout router") as sock:
        pool = RolloutPool.over_workers(
            args.worker_urls, api_key=args.worker_api_key, model_path=args.model_path,
            pool_options=pool_options, loop_factory=server_loop,
        )  # fmt: skip
        what = f"workers {' '.join(args.worker_urls)}"
        return run_server(pool, sock, options, signals, what, relay=True)


def serve_replicas(options: ServerOptions, engine_options: dict[str, Any], replicas: int) -> int:
    """`rollout serve --dp-size N`: the server over a RolloutPool of N replicas on a local Ray
    cluster (one node), instead of one engine. Returns the exit status, as serve does."""
    import torch

    from rollout.pool.pool import RolloutPool

    with ShutdownSignals() as signals:
        try:
            options_left = dict(engine_options)
            model_path = options_left.pop("model_path")
            # Fewer GPUs than replicas x ranks: the replicas share them (each with its
            # mem_fraction); otherwise one GPU per rank.
            tp, gpus = int(options_left.get("tp_size") or 1), torch.cuda.device_count()
            share = gpus / replicas if tp == 1 and 0 < gpus < replicas else None
            with listen(options.host, options.port) as sock:
                pool = RolloutPool(
                    model_path, replicas=replicas, num_gpus_per_replica=share,
                    loop_factory=server_loop, **options_left,
                )  # fmt: skip
                what = f"{replicas} replicas of {model_path}"
                return run_server(pool, sock, options, signals, what)
        except StartInterrupted:
            return 0


def run_server(
    pool: Any, sock: socket.socket, options: ServerOptions, signals: ShutdownSignals, what: str,
    relay: bool = False,
) -> int:  # fmt: skip
    """Serves `pool` on `sock` (launch.listen's, bound before the pool started; the caller
    closes it) with rollout serve's app until a shutdown signal; shuts the pool down. The
    server runs on the pool's own event loop (made by server_loop; serve_on_loop). `relay` (for
    a pool of HTTP workers): a one-prompt /generate goes to its worker as the client sent it,
    answered on the connection (relay_connection.py) or through the app (generate_relay.py)."""
    from rollout.pool.generate_relay import relay_front
    from rollout.pool.relay_connection import RelaySetup
    from rollout.server.app import create_app

    try:
        app = create_app(pool, options)
        served, http = app, "auto"
        if relay:
            served = relay_front(app, pool.dispatcher, options)
            http = RelaySetup(pool.dispatcher, app.state, options).protocol()
        config = uvicorn.Config(
            served, host=options.host, port=options.port, log_level=options.log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, http=http,
        )  # fmt: skip
        server = signals.server = EngineServer(config, pool, app.state)
        url = f"http://{options.host}:{options.port}"
        print(f"rollout: serving {what} on {url}", file=sys.stderr, flush=True)
        serve_on_loop(server, pool, sock)
    finally:
        pool.shutdown()
    return EXIT_ENGINE_DIED if server.engine_died else 0


if __name__ == "__main__":
    sys.exit(main())
