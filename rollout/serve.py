"""`rollout serve` (also `python -m rollout.serve`): one engine behind the HTTP server, or with
--dp-size N a pool of N replicas on this node behind the same server and a prefix-aware router."""

from __future__ import annotations

import sys

from rollout.engine.processes import start_fork_server
from rollout.server.launch import parse, serve


def main(argv: list[str] | None = None, prog: str = "rollout serve") -> int:
    """Returns the exit status: 0 after a shutdown signal, 1 when the engine died while serving."""
    options, engine_options = parse(argv, prog)
    if options.dp_size > 1:  # the replicas' processes start their engines, not this one
        from rollout.pool.http_router import serve_replicas

        return serve_replicas(options, engine_options, options.dp_size)
    start_fork_server()  # the engine's processes' imports, beside the server's own
    return serve(options, engine_options)


if __name__ == "__main__":
    sys.exit(main(prog="python -m rollout.serve"))
