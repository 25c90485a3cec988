"""JSON text for the server's answers, and for large ones, made in pieces.

json.dumps is C code that holds the GIL from start to end (RESULTS.md has what a large
response costs), during which the server's event loop (which needs the GIL) answers nothing, whichever
thread runs it. render_in_pieces gives the same text, made of json.dumps calls on parts of about
PIECE_ITEMS values each; between parts it runs Python code, where the GIL passes to the loop.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.encoders import jsonable_encoder

PIECE_ITEMS = 16_384  # values per json.dumps call: a few ms of holding the GIL


def dumps(content: Any) -> str:
    """JSON that tolerates non-finite floats (a -inf logprob is a value, not a server error);
    what json can't encode (e.g. a pydantic model) goes through FastAPI's encoder first."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=True, separators=(",", ":"), default=jsonable_encoder
    )  # fmt: skip


def estimate_items(value: Any) -> int:
    """About how many JSON values `value` holds. Lists are sampled (first, middle and last
    element), so this costs little for long ones; a long string counts by its length."""
    if isinstance(value, dict):
        return 1 + sum(estimate_items(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        if not value:
            return 1
        n = len(value)
        each = max(estimate_items(value[i]) for i in (0, n // 2, -1))
        return 1 + n * each
    if isinstance(value, str):
        return 1 + len(value) // 64
    return 1


def render_in_pieces(content: Any) -> bytes:
    """dumps(content).encode(), the same bytes, made in parts (see the module's doc)."""
    out: list[str] = []
    _render(content, out)
    # Encoded part by part: joining bytes (unlike str) lets go of the GIL for large results.
    return b"".join([part.encode() for part in out])


def _render(value: Any, out: list[str]) -> None:
    size = estimate_items(value)
    if size <= PIECE_ITEMS:
        out.append(dumps(value))
    elif isinstance(value, dict) and all(isinstance(k, str) for k in value):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(("," if i else "") + dumps(key) + ":")
            _render(item, out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        step = max(1, PIECE_ITEMS * len(value) // size)  # elements per part
        for i in range(0, len(value), step):
            if i:
                out.append(",")
            if step == 1:
                _render(value[i], out)
            else:
                out.append(dumps(list(value[i : i + step]))[1:-1])  # without its [ ]
        out.append("]")
    else:  # a long string, or a dict json.dumps must convert the keys of
        out.append(dumps(value))
