"""Sampling values at the edges of float32 act as their limit, on the torch sampler and on the
Triton kernel alike: a temperature too small for float32 is greedy, a top_p too small keeps the
top token, a min_p too small cuts nothing. Values no float32 can hold (inf, nan, > 3.4e38) and
out-of-range ones are a ValueError at validation, and over HTTP a 400: no sampling value makes
the server answer a 5xx or stop serving (issue 18)."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch
from server_helpers import start_server, stop_server

from rollout.engine.sampler import SamplingBatch, sample
from rollout.engine.sampling_params import FLOAT32_MAX
from rollout.engine.sampling_params import SamplingParams as SP

VOCAB = 300
ROWS = 4
# Smallest float64 denormal, float32 denormals, values float32 rounds to 0, and tiny normals.
TINY = [5e-324, 1e-50, 1e-46, 1e-45, 1e-40, 1e-38, 1e-31]


def _logits(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, VOCAB, generator=gen) * 3


def _batch(params: SP, prompt: list[int] | None = None, eos: int = 2) -> SamplingBatch:
    prompts = [prompt or [1]] * ROWS
    return SamplingBatch.build(
        [params] * ROWS, list(range(ROWS)), [[]] * ROWS, prompts, [eos], VOCAB, "cpu"
    )


def _torch_sample(logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
    return sample(logits.clone(), batch).tolist()


@pytest.mark.parametrize("temperature", [0.0, *TINY])
@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_tiny_temperature_is_greedy(temperature, top_p):
    logits = _logits()
    batch = _batch(SP(temperature=temperature, top_p=top_p))
    assert _torch_sample(logits, batch) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", TINY)
@pytest.mark.parametrize("temperature", [1.0, 1e-50])
def test_tiny_top_p_keeps_the_top_token(top_p, temperature):
    logits = _logits(1)
    assert (
        _torch_sample(logits, _batch(SP(temperature=temperature, top_p=top_p)))
        == logits.argmax(-1).tolist()
    )


@pytest.mark.parametrize("min_p", [5e-324, 1e-50, 1e-45])
def test_tiny_min_p_cuts_nothing(min_p):
    # The same seeds with min_p off draw the same tokens: nothing was cut (and flat logits
    # make the draw land away from the argmax, so a cut would show).
    logits = _logits(2) * 0.01
    off = _torch_sample(logits, _batch(SP(temperature=1.0)))
    assert _torch_sample(logits, _batch(SP(temperature=1.0, min_p=min_p))) == off
    assert off != logits.argmax(-1).tolist()


def test_min_p_one_keeps_the_top_token():
    logits = _logits(3)
    assert (
        _torch_sample(logits, _batch(SP(temperature=5.0, min_p=1.0))) == logits.argmax(-1).tolist()
    )


def test_huge_temperature_stays_off_banned_tokens():
    # logits / 3.4e38 is ~0 everywhere (uniform), and a banned token's -inf stays -inf (not nan).
    eos = 7
    logits = _logits(4)
    logits[:, eos] = 1e30
    params = SP(temperature=FLOAT32_MAX, min_new_tokens=1, max_new_tokens=4)
    tokens = _torch_sample(logits, _batch(params, eos=eos))
    assert all(0 <= t < VOCAB and t != eos for t in tokens)


@pytest.mark.parametrize("penalty", [5e-324, 1e-50, 1e-45])
def test_tiny_repetition_penalty_picks_the_likeliest_seen_token(penalty):
    # A penalty near 0 divides the positive logits of seen tokens toward +inf: the seen token
    # with the largest positive logit wins, whatever the others.
    logits = _logits(5)
    logits[:, 3], logits[:, 9], logits[:, 11] = 0.5, 0.9, -0.2
    tokens = _torch_sample(
        logits, _batch(SP(temperature=1.0, repetition_penalty=penalty), [3, 9, 11])
    )
    assert tokens == [9] * ROWS


FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
]
UNREPRESENTABLE = [math.inf, -math.inf, math.nan, 1e39, 1e300, -1e300, 10**400, -(10**400)]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", UNREPRESENTABLE, ids=lambda v: repr(v)[:12])
def test_values_no_float32_holds_are_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SP(**{field: value})


OUT_OF_RANGE = [
    ("temperature", -1e-50),
    ("top_p", 0.0),
    ("top_p", -1e-45),
    ("min_p", -5e-324),
    ("repetition_penalty", 0.0),
]


@pytest.mark.parametrize("field, value", OUT_OF_RANGE)
def test_out_of_range_edges_are_a_value_error(field, value):
    with pytest.raises(ValueError, match=field):
        SP(**{field: value})


# ---- the Triton kernel (compiled on a GPU, interpreted on CPU tensors) ------------------------


@pytest.fixture(scope="module")
def kernel():
    pytest.importorskip("triton")
    from rollout_kernels.sampling import sample_tokens

    return sample_tokens


def _kernel_sample(sample_tokens, logits: torch.Tensor, b: SamplingBatch, device: str) -> list[int]:
    rows = (b.temperatures, b.greedy, b.top_ks, b.top_ps, b.min_ps, b.seeds, b.steps)
    out = sample_tokens(
        logits.to(device), *(t.to(device) for t in rows),
        use_top_k=b.top_k_max > 0, use_top_p=b.use_top_p, use_min_p=b.use_min_p, block=128,
    )  # fmt: skip
    return out.tolist()


EDGE_ROWS = [
    SP(temperature=1e-50),
    SP(temperature=1e-45, top_p=0.9),
    SP(temperature=1e-40, top_k=5, min_p=0.1),
    SP(temperature=1.0, top_p=1e-50),
    SP(temperature=1.0, top_p=5e-324),
    SP(temperature=0.7, top_p=1e-45, top_k=20),
    SP(temperature=1.0, top_p=1e-50, min_p=1e-50),
]


@pytest.mark.parametrize("params", EDGE_ROWS, ids=lambda p: f"T{p.temperature:g}-p{p.top_p:g}")
def test_kernel_gives_the_limit_like_the_torch_sampler(kernel, params):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = _logits(6)
    batch = _batch(params)
    want = logits.argmax(-1).tolist()
    assert _torch_sample(logits, batch) == want
    assert _kernel_sample(kernel, logits, batch, device) == want


def test_kernel_top_p_zero_keeps_the_top_token(kernel):
    # Called directly, with a top_p the host would never send: the top token still stays.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = _logits(7)
    batch = _batch(SP(temperature=1.0, top_p=0.5))
    batch.top_ps = torch.zeros(ROWS)
    assert _kernel_sample(kernel, logits, batch, device) == logits.argmax(-1).tolist()


# ---- over HTTP ----------------------------------------------------------------------------------

EDGE_VALUES = [
    0.0,
    5e-324,
    1e-45,
    1e-50,
    1e-30,
    1e-38,
    -1e-50,
    math.inf,
    -math.inf,
    math.nan,
    1e39,
    1e300,
]
HTTP_FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"]
GREEDY = {"text": "The answer is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    proc, url = start_server(tiny_qwen3, "--context-length", "64")
    yield url
    stop_server(proc)


def _bodies(model: str, field: str, value: float) -> list[tuple[str, dict]]:
    """One request per generation endpoint, streamed and not, with `field` set to `value`."""
    out = []
    for stream in (False, True):
        native = {"temperature": 1.0, field: value, "max_new_tokens": 3}
        out.append(("/generate", {"text": "Hello", "sampling_params": native, "stream": stream}))
        oai = {"model": model, field: value, "max_tokens": 3, "stream": stream}
        out.append(("/v1/completions", {**oai, "prompt": "Hello"}))
        out.append(
            ("/v1/chat/completions", {**oai, "messages": [{"role": "user", "content": "Hi"}]})
        )
    return out


def _assert_clean(resp: httpx.Response, what: str) -> None:
    body = resp.text
    assert resp.status_code == 200 or 400 <= resp.status_code < 500, (
        f"{what}: {resp.status_code} {body}"
    )
    if resp.status_code != 200:
        message = resp.json()["error"]["message"]
        assert "Traceback" not in message and ".py" not in message, f"{what}: {message}"
        return
    if resp.headers["content-type"].startswith("text/event-stream"):
        events = [line[5:].strip() for line in body.splitlines() if line.startswith("data:")]
        assert events[-1] == "[DONE]", what
        for event in events[:-1]:
            assert "error" not in json.loads(event), f"{what}: {event}"


def test_edge_values_on_every_endpoint_get_a_200_or_a_clean_400(server):
    statuses: dict[str, set[int]] = {}
    with httpx.Client(timeout=60) as http:
        model = http.get(f"{server}/v1/models").json()["data"][0]["id"]
        before = http.post(f"{server}/generate", json=GREEDY).json()["output_ids"]
        for field in HTTP_FIELDS:
            for value in EDGE_VALUES:
                for path, body in _bodies(model, field, value):
                    # allow_nan: JSON's NaN and Infinity, as Python's json sends and reads them.
                    content = json.dumps(body, allow_nan=True)
                    resp = http.post(
                        f"{server}{path}",
                        content=content,
                        headers={"content-type": "application/json"},
                    )
                    _assert_clean(resp, f"{path} {field}={value!r} stream={body.get('stream')}")
                    statuses.setdefault(f"{path} stream={body.get('stream')}", set()).add(
                        resp.status_code
                    )
        assert http.get(f"{server}/health").status_code == 200
        assert http.post(f"{server}/generate", json=GREEDY).json()["output_ids"] == before
    # Every endpoint both generated (edge values in range) and refused (values out of range).
    assert len(statuses) == 6 and all(s == {200, 400} for s in statuses.values()), statuses
