"""SGLang's `update_weights_from_tensor`: `serialized_named_tensors` (one payload per rank: base64
of torch's ForkingPickler, as SGLang's MultiprocessingSerializer makes it) with load_format,
flush_cache, abort_all_requests and weight_version, admin-only over HTTP; the Engine API's
(name, tensor) list, pre-serialized payloads and {"flattened_tensor", "metadata"} bucket. Outputs
then equal transformers on the new weights. A payload with any global other than torch's tensor
rebuilds is refused before it runs, and changes nothing.

On CPU the tensors cross by shared-memory file name: the sender uses torch's "file_system"
sharing strategy (a file descriptor cannot travel in an HTTP body).
"""

from __future__ import annotations

import base64
import builtins
import io
import os
import pickle
import random
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import httpx
import pytest
import torch
import torch.multiprocessing
from hf_reference import hf_greedy
from server_helpers import start_server, stop_server
from sglang_shapes import checkpoint_tensors

NEW_TOKENS = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
_rng = random.Random(2727)
PROMPTS = [[_rng.randrange(3, 800) for _ in range(n)] for n in (7, 15)]
ADMIN = {"Authorization": "Bearer admin"}


# ---- what an SGLang-style trainer sends -------------------------------------------------------
@dataclass
class FlattenedTensorMetadata:  # the fields of SGLang's record (its module is not needed here)
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def serialize(obj) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True)."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def flattened_bucket(named: list[tuple[str, torch.Tensor]]) -> dict:
    """SGLang's FlattenedTensorBucket: every tensor's bytes back to back, with their records."""
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in named])
    records, pos = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        records.append(FlattenedTensorMetadata(name, t.shape, t.dtype, pos, pos + n, n))
        pos += n
    return {"flattened_tensor": flat, "metadata": records}


class _Runs:
    """A pickle that, unpickled in general, would run `fn(arg)`."""

    def __init__(self, fn, arg) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


@pytest.fixture(scope="module")
def expected(tiny_qwen3, tiny_qwen3_perturbed) -> dict[str, list[list[int]]]:
    return {
        "base": hf_greedy(tiny_qwen3, PROMPTS, NEW_TOKENS),
        "perturbed": hf_greedy(tiny_qwen3_perturbed, PROMPTS, NEW_TOKENS),
    }


# ---- over HTTP --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(tiny_qwen3):
    proc, base = start_server(
        tiny_qwen3, "--api-key", "user", "--admin-api-key", "admin", api_key="user"
    )
    yield base
    stop_server(proc)


def _post(url: str, path: str, body: dict, headers=ADMIN) -> httpx.Response:
    return httpx.post(f"{url}/{path}", json=body, headers=headers, timeout=120)


def _http_greedy(url: str) -> list[list[int]]:
    body = {"input_ids": PROMPTS, "sampling_params": GREEDY}
    return [o["output_ids"] for o in _post(url, "generate", body).json()]


def _version(url: str) -> str:
    return httpx.get(f"{url}/get_weight_version", headers=ADMIN).json()["weight_version"]


def _tensor_body(payload: str, **extra) -> dict:
    return {
        "serialized_named_tensors": [payload], "load_format": None, "flush_cache": False,
        "abort_all_requests": False, "weight_version": None, **extra,
    }  # fmt: skip


def test_serialized_named_tensors_over_http(url, expected, tiny_qwen3, tiny_qwen3_perturbed):
    named = checkpoint_tensors(tiny_qwen3_perturbed)
    body = _tensor_body(serialize(named), weight_version="sg-tensor-1")
    assert _post(url, "update_weights_from_tensor", body, {"Authorization": "Bearer user"}).status_code == 403
    assert _http_greedy(url) == expected["base"]  # the user's call changed nothing

    reply = _post(url, "update_weights_from_tensor", body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["success"] and _version(url) == "sg-tensor-1"
    assert _http_greedy(url) == expected["perturbed"]

    bucket = flattened_bucket(checkpoint_tensors(tiny_qwen3))
    body = _tensor_body(serialize(bucket), load_format="flattened_bucket", abort_all_requests=True)
    reply = _post(url, "update_weights_from_tensor", body)
    assert reply.status_code == 200, reply.text
    assert _http_greedy(url) == expected["base"]
    del named, bucket  # the sender keeps its tensors until the engine has answered


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(lambda marker: [("model.norm.weight", _Runs(os.system, f"touch {marker}"))], id="os.system"),
        pytest.param(lambda marker: [("model.norm.weight", _Runs(builtins.eval, f"open({str(marker)!r}, 'w')"))], id="builtins.eval"),
        pytest.param(lambda marker: _Runs(builtins.exec, f"open({str(marker)!r}, 'w')"), id="builtins.exec"),
    ],
)  # fmt: skip
def test_a_payload_with_any_other_global_is_refused_and_changes_nothing(url, expected, tmp_path, payload):
    marker = tmp_path / "ran"
    before, version = _http_greedy(url), _version(url)
    text = base64.b64encode(pickle.dumps(payload(marker))).decode()
    reply = _post(url, "update_weights_from_tensor", _tensor_body(text, weight_version="evil"))
    assert reply.status_code == 400, reply.text
    assert "refused the global" in reply.json()["error"]["message"]
    assert not marker.exists()
    assert _version(url) == version and _http_greedy(url) == before


def test_a_general_pickle_of_tensors_is_refused(url):
    """pickle.dumps of a tensor rebuilds it through torch.load of bytes: a general unpickle."""
    text = base64.b64encode(pickle.dumps([("model.norm.weight", torch.ones(16))])).decode()
    reply = _post(url, "update_weights_from_tensor", _tensor_body(text))
    assert reply.status_code == 400 and "refused the global torch._utils" in reply.text


# ---- through the Engine API -------------------------------------------------------------------
def _greedy(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_the_engine_takes_sglangs_tensor_forms(engine, expected, tiny_qwen3, tiny_qwen3_perturbed):
    success, message = engine.update_weights_from_tensor(checkpoint_tensors(tiny_qwen3_perturbed))
    assert success, message
    assert _greedy(engine) == expected["perturbed"]

    bucket = flattened_bucket(checkpoint_tensors(tiny_qwen3))
    result = engine.update_weights_from_tensor(bucket, load_format="flattened_bucket", flush_cache=False)
    assert tuple(result)[:1] == (True,) and len(result) == 2
    assert _greedy(engine) == expected["base"]

    payloads = [serialize(checkpoint_tensors(tiny_qwen3_perturbed))]  # pre-serialized, one per rank
    success, _ = engine.update_weights_from_tensor(payloads, weight_version="pre-serialized")
    assert success and engine.get_weight_version() == "pre-serialized"
    assert _greedy(engine) == expected["perturbed"]


def test_a_bad_bucket_rolls_back(engine, expected, tiny_qwen3, tiny_qwen3_perturbed):
    engine.update_weights_from_tensor(checkpoint_tensors(tiny_qwen3), weight_version="kept")
    named = checkpoint_tensors(tiny_qwen3_perturbed)
    bucket = flattened_bucket(named)
    bucket["metadata"][-1].shape = torch.Size([3, 3])  # no longer the model's shape
    with pytest.raises(ValueError):
        engine.update_weights_from_tensor(bucket, load_format="flattened_bucket")
    wrong = [("model.layers.0.no_such.weight", named[0][1]), *named[1:]]
    with pytest.raises(ValueError, match="unknown weight name"):
        engine.update_weights_from_tensor([serialize(wrong)])
    assert engine.get_weight_version() == "kept" and _greedy(engine) == expected["base"]
