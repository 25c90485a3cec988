"""The JSON response used by every route, and the error body shape."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse


class JSON(JSONResponse):
    """JSON that tolerates non-finite floats (a -inf logprob is a value, not a server error)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=True, separators=(",", ":")).encode()


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSON:
    return JSON({"error": {"message": message, "type": kind, "code": status}}, status_code=status)
