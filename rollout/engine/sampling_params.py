"""SamplingParams: how one request samples its tokens (SGLang's names and defaults)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout.engine.grammar_spec import GRAMMAR_FIELDS, GrammarSpec, grammar_fields
from rollout.errors import InvalidRequest

# Every float field must fit in float32, the precision the sampler computes in: a larger value
# would become inf there.
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max
# NOTE: valid values too small for float32 act as their limit; SamplingBatch.build applies these
# for the torch sampler and the kernel alike. float32 rounds 1e-50 to 0, and GPUs may flush
# denormals (below 1.2e-38) to 0.
# A temperature below this is greedy: logits / T would overflow float32 from |logits| ~ 3e8 on
# (a division by zero at 0), and so small a temperature takes the argmax anyway.
MIN_TEMPERATURE = 1e-30
# top_p or min_p below this: top_p keeps the top token only, min_p cuts nothing.
MIN_PROBABILITY = 1e-30
# A repetition penalty divides positive logits: below this it acts as this (still finite).
MIN_REPETITION_PENALTY = 1e-30


@dataclass
class SamplingParams:
    """Validated and normalized on construction: every bad field raises ValueError naming the
    field, the allowed values and the value got. After construction `stop` and
    `stop_token_ids` are lists and every float field holds a float."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens exist
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens
    frequency_penalty: float = 0.0  # over output tokens, times their count
    presence_penalty: float = 0.0  # over output tokens, once each
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False  # EOS does not finish the request (min_new_tokens still bans it)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the output text
    n: int = 1
    seed: int | None = None
    # Added to the logits of these token ids before sampling (OpenAI's and SGLang's: keys are
    # ids, as strings in JSON; values in [-100, 100]). None or {}: no bias.
    logit_bias: dict[int, float] | None = None
    # The output must match this grammar (at most one; see rollout.engine.grammar_spec): a
    # JSON schema (string or object), a regular expression, an xgrammar EBNF grammar with a
    # `root` rule, or an xgrammar structural tag (JSON). The grammar ends the output with EOS.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, lambda x: x >= 0, ">= 0")
        _check_int("min_new_tokens", self.min_new_tokens, lambda x: x >= 0, ">= 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequest(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens}"
            )
        self.temperature = _float("temperature", self.temperature, lambda x: x >= 0, ">= 0")
        self.top_p = _float("top_p", self.top_p, lambda x: 0 < x <= 1, "in (0, 1]")
        _check_int("top_k", self.top_k, lambda x: x == -1 or x >= 1, "-1 (off) or >= 1")
        self.min_p = _float("min_p", self.min_p, lambda x: 0 <= x <= 1, "in [0, 1]")
        self.repetition_penalty = _float(
            "repetition_penalty", self.repetition_penalty, lambda x: x > 0, "> 0"
        )
        for name in ("frequency_penalty", "presence_penalty"):
            value = _float(name, getattr(self, name), lambda x: -2 <= x <= 2, "in [-2, 2]")
            setattr(self, name, value)
        self.stop = _stop_list(self.stop)
        self.stop_token_ids = _token_id_list(self.stop_token_ids)
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_int("n", self.n, lambda x: x >= 1, ">= 1")
        if self.seed is not None:
            _check_int("seed", self.seed, lambda x: True, "an int or None")
        self.logit_bias = _logit_bias(self.logit_bias)
        self._check_grammar()

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Builds from a JSON-style dict (None: all defaults). Unknown keys raise ValueError."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise InvalidRequest(f"sampling params must be a dict, got {type(d).__name__}")
        d = _from_sglang_names(d)
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in d if k not in valid)
        if unknown:
            raise InvalidRequest(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; "
                f"valid ones are: {', '.join(valid)}"
            )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (lists copied) that `from_dict` turns back into equal params."""
        return dataclasses.asdict(self)

    @property
    def grammar(self) -> GrammarSpec | None:
        """The grammar the output must match, if any (fields already checked)."""
        for kind in GRAMMAR_FIELDS:
            text = getattr(self, kind)
            if text is not None:
                return GrammarSpec(kind, text)
        return None

    def _check_grammar(self) -> None:
        spec = grammar_fields({name: getattr(self, name) for name in GRAMMAR_FIELDS})
        if spec is None:
            return
        setattr(self, spec.kind, spec.text)  # a JSON schema object becomes its JSON text
        # The grammar ends the output by allowing only EOS once it is complete.
        if self.ignore_eos:
            raise InvalidRequest(f"ignore_eos can't be combined with {spec.kind}")
        if self.min_new_tokens:
            raise InvalidRequest(
                f"min_new_tokens can't be combined with {spec.kind}: the grammar decides where "
                f"the output ends, got min_new_tokens={self.min_new_tokens}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


def _from_sglang_names(d: dict[str, Any]) -> dict[str, Any]:
    """d with SGLang's other names for our fields translated: `sampling_seed` is `seed`, and
    `custom_params` (read only by custom logit processors, which requests can't send here)
    must be a dict or null and has nothing to act on."""
    if "sampling_seed" not in d and "custom_params" not in d:
        return d
    d = dict(d)
    seed = d.pop("sampling_seed", None)
    if seed is not None:
        if d.get("seed") not in (None, seed):
            raise InvalidRequest(f"seed ({d['seed']!r}) and sampling_seed ({seed!r}) disagree")
        d["seed"] = seed
    custom = d.pop("custom_params", None)
    if custom is not None and not isinstance(custom, dict):
        raise InvalidRequest(f"custom_params must be a dict or null, got {type(custom).__name__}")
    return d


_BOOL_FIELDS = (
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
)


def _check_int(name: str, value: Any, ok: Callable[[int], bool], allowed: str) -> None:
    # NOTE: bool is a subclass of int; `top_k=True` is a bug in the caller, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be an int, got {value!r}")
    if not ok(value):
        raise InvalidRequest(f"{name} must be {allowed}, got {value}")


def _float(name: str, value: Any, ok: Callable[[float], bool], allowed: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float64
        raise InvalidRequest(
            f"{name} must be {allowed} and at most {FLOAT32_MAX:.4g} (float32), got an int "
            f"of {value.bit_length()} bits"
        ) from None
    if not math.isfinite(value) or not ok(value):
        raise InvalidRequest(f"{name} must be {allowed}, got {value}")
    if abs(value) > FLOAT32_MAX:
        raise InvalidRequest(
            f"{name} must be {allowed} and at most {FLOAT32_MAX:.4g} (float32), got {value}"
        )
    return value


def _stop_list(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return list(stops)


def _token_id_list(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise InvalidRequest(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
    return list(ids)


MAX_LOGIT_BIAS = 100.0


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """{token id: bias} from a dict keyed by ids or their decimal strings; None if empty."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidRequest(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.strip().isdigit():
            token = int(key)
        if token is None or token < 0:
            raise InvalidRequest(f"logit_bias keys must be token ids >= 0, got {key!r}")
        out[token] = _float(
            f"logit_bias[{key!r}]", value, lambda x: abs(x) <= MAX_LOGIT_BIAS,
            f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        )  # fmt: skip
    return out or None


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Every biased id must be in the model's vocabulary."""
    bad = [t for t in params.logit_bias or () if t >= vocab_size]
    if bad:
        raise InvalidRequest(f"logit_bias keys must be ids in [0, {vocab_size}), got {bad[:5]}")
