"""`rollout serve` for the router tests: the same server, with a discard_staged_weights route
where the server has none yet (the engine's stand-in from pool_helpers).

    python tests/pool_worker.py --model-path ... --port ...   # as rollout serve
"""

from __future__ import annotations

import sys

from pool_helpers import install_discard_fallback


def main() -> int:
    install_discard_fallback()
    import rollout.server.app as app_module
    from rollout.serve import main as serve_main

    make_app = app_module.create_app

    def create_app(engine, options):
        app = make_app(engine, options)
        if not any(getattr(r, "path", None) == "/discard_staged_weights" for r in app.routes):
            app.post("/discard_staged_weights")(lambda: engine.discard_staged_weights())
        return app

    app_module.create_app = create_app
    return serve_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
