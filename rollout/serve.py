"""`python -m rollout.serve --model-path PATH ...`: the same as `rollout serve`."""

from __future__ import annotations

import sys

from rollout.server.launch import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m rollout.serve"))
