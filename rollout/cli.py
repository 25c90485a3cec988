"""The `rollout` command: `rollout tiny-model PATH`, `rollout generate ...`, `rollout serve ...`."""

from __future__ import annotations

import argparse
import json
import sys


def _tiny_model(args: argparse.Namespace) -> None:
    from rollout.tiny_model import make_tiny_model

    path = make_tiny_model(args.path, arch=args.arch, seed=args.seed, num_labels=args.num_labels)
    print(path)


def _generate(args: argparse.Namespace) -> None:
    from rollout import RolloutEngine

    params = json.loads(args.sampling_params) if args.sampling_params else {}
    params.setdefault("max_new_tokens", args.max_new_tokens)
    with RolloutEngine(args.model_path, device=args.device, dtype=args.dtype) as engine:
        prompt = args.prompt if len(args.prompt) > 1 else args.prompt[0]
        print(json.dumps(engine.generate(prompt, params), indent=1))


def main(argv: list[str] | None = None) -> int:
    """Returns the exit status (`rollout serve`: 1 when the engine died while serving)."""
    parser = argparse.ArgumentParser(prog="rollout", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tiny-model", help="write a small random checkpoint with a local tokenizer")
    p.add_argument("path", help="directory to write")
    p.add_argument("--arch", choices=["llama", "qwen2", "qwen3"], default="qwen3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-labels",
        type=int,
        default=None,
        help="write a sequence classifier with this many outputs (1: a reward model) instead of a causal LM",
    )
    p.set_defaults(func=_tiny_model)

    p = sub.add_parser("generate", help="generate from one prompt and print the result as JSON")
    p.add_argument("--model-path", required=True)
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--sampling-params", help="JSON object of sampling parameters")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default="auto")
    p.set_defaults(func=_generate)

    sub.add_parser("serve", help="serve a model over HTTP (see rollout serve --help)", add_help=False)
    sub.add_parser(
        "router",
        help="route requests over several rollout serve workers (see rollout router --help)",
        add_help=False,
    )

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        from rollout.serve import main as serve_main

        return serve_main(argv[1:])
    if argv and argv[0] == "router":
        from rollout.pool.http_router import main as router_main

        return router_main(argv[1:])
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
