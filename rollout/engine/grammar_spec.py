"""What a request's output must match: one of SamplingParams' grammar fields (SGLang's names),
checked when the params are built so that a bad schema or pattern is the caller's 400.

`json_schema` (a JSON Schema, as a string or an object), `regex`, `ebnf` (xgrammar's EBNF, a
`root` rule) and `structural_tag` (xgrammar's structural tag JSON) are exclusive. Checking
parses the grammar with xgrammar (no tokenizer needed); the scheduler compiles it against the
vocabulary later (rollout.engine.grammar_backend).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from rollout.errors import InvalidRequest

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")

# JSON is generated without free whitespace (", " and ": " between items): whitespace a model
# may repeat forever is the usual way a constrained output fails to end.
JSON_ANY_WHITESPACE = False

# xgrammar's errors start with a timestamp and the C++ source line: "[12:32:01] /x/y.cc:83: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: which field gave it, and its text (a JSON schema as compact JSON)."""

    kind: str  # one of GRAMMAR_FIELDS
    text: str


def grammar_fields(values: dict[str, Any]) -> GrammarSpec | None:
    """The one grammar among `values` (field -> value, None when unset), normalized and
    checked; raises InvalidRequest naming the field when it is bad or when two are set."""
    given = [name for name in GRAMMAR_FIELDS if values.get(name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(
            f"only one of {', '.join(GRAMMAR_FIELDS)} may be set, got {' and '.join(given)}"
        )
    kind = given[0]
    value = values[kind]
    if kind in ("json_schema", "structural_tag") and isinstance(value, (dict, bool)):
        value = json.dumps(value)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{kind} must be a non-empty string, got {value!r}")
    _check(kind, value)
    return GrammarSpec(kind, value)


@lru_cache(maxsize=256)
def _check(kind: str, text: str) -> None:
    """Raises InvalidRequest if xgrammar can't build a grammar from `text`. (Cached: the n
    samples of a request, and RL batches, repeat the same schema.)"""
    xgr = import_xgrammar(kind)
    if kind in ("json_schema", "structural_tag"):
        try:
            json.loads(text)
        except ValueError as e:
            raise InvalidRequest(f"{kind} must be valid JSON: {e}") from None
    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(text, any_whitespace=JSON_ANY_WHITESPACE)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
        else:
            xgr.Grammar.from_structural_tag(text)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError variants
        raise InvalidRequest(f"{kind} is not a valid {_WHAT[kind]}: {_message(e)}") from None


_WHAT = {
    "json_schema": "JSON schema",
    "regex": "regular expression",
    "ebnf": "EBNF grammar",
    "structural_tag": "structural tag",
}


def _message(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return _LOG_PREFIX.sub("", text[0]) if text else type(error).__name__


def import_xgrammar(field: str = "a grammar") -> Any:
    """The xgrammar module, or InvalidRequest saying how to install it."""
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequest(
            f"{field} needs the xgrammar package: pip install 'rollout[grammar]'"
        ) from None
    return xgrammar
