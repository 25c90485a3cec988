"""One typed message per control call (issue 19): each call is one dataclass checked where it is
built, crosses to the scheduler as plain JSON (never pickled) and comes back whole; a failure
is one kind, raised as one Python exception and answered with one HTTP status; only the
caller's mistakes are 4xx. weight_sync is given the engine as a narrow port and never imports
it. The engine part shares one CPU engine for the module."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from rollout import RolloutEngine
from rollout.client import _exception
from rollout.engine.control_calls import CALLS, FlushCache, GetServerInfo, Shutdown
from rollout.engine.lora_calls import LoadLoraAdapter, UnloadLoraAdapter
from rollout.engine.messages import CONTROL_TAG, AbortRequest, ControlReply, ControlRequest
from rollout.errors import (
    ControlError,
    Forbidden,
    InvalidRequest,
    InvalidRequestType,
    WeightSyncError,
)
from rollout.server.app import create_app
from rollout.server.options import ServerOptions
from rollout.weight_sync import calls
from rollout.weight_sync.tensor_handles import share_tensors

NORM = "model.norm.weight"


def _one_of_each(sent) -> list:
    """A call of every kind the scheduler takes, with arguments other than the defaults."""
    return [
        FlushCache(), GetServerInfo(), Shutdown(), AbortRequest(rid="r-1"),
        calls.InitWeightsUpdateGroup("127.0.0.1", 29500, 1, 2, "g", "gloo", 30),
        calls.DestroyWeightsUpdateGroup("g"),
        calls.UpdateWeightsFromDistributed(
            ["a", "b"], [torch.bfloat16, "float32"], [[2, 3], [4]], "g", True, "v1",
            "flattened_bucket",
        ),
        calls.UpdateWeightsFromTensor(sent.handles, "flattened_bucket", True, "v2"),
        calls.UpdateWeightsFromDisk("/ckpt/step-1", "safetensors", "v3", ["/ckpt"]),
        calls.GetWeightsByName(NORM, 3), calls.GetWeightVersion(),
        calls.UpdateWeightVersion("v4", True), calls.PauseGeneration("retract"),
        calls.ContinueGeneration(), calls.DiscardStagedWeights(),
        calls.ReleaseMemoryOccupation(["kv_cache"]),
        calls.ResumeMemoryOccupation(None),
        LoadLoraAdapter("math", "/adapters/math", ["/adapters"]), UnloadLoraAdapter("math"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "name, message",
    [
        ("a:b", "must not contain ':'"),
        ("a\x00b", "must not contain control characters, got U.0000 at position 1"),
        ("tab\there", "must not contain control characters, got U.0009"),
        ("s\ud800", "is not valid Unicode"),
    ],
)
def test_an_adapter_name_that_lists_badly_is_refused(name, message):
    with pytest.raises(InvalidRequest, match=f"lora_name {message}"):
        LoadLoraAdapter(name, "/adapters/math")
    assert LoadLoraAdapter("org/math-v2 ü", "/adapters/math").lora_name == "org/math-v2 ü"


def test_every_call_crosses_as_json_and_comes_back_equal():
    sent = share_tensors([("w", torch.randn(4, 4))])
    samples = _one_of_each(sent)
    assert {c.method for c in samples} == set(CALLS)  # every call the scheduler takes
    for call in samples:
        frames = ControlRequest(7, call).to_frames()
        assert frames[0] == CONTROL_TAG
        wire = json.loads(frames[1])  # plain data: nothing pickled
        assert (wire["id"], wire["call"]) == (7, call.method)
        assert ControlRequest.from_frames(frames, CALLS) == ControlRequest(7, call)
    sent.close()
    error = ControlError("forbidden", "not under an allowed root")
    for reply in (ControlReply(3, {"values": [[1.5, float("-inf")]]}), ControlReply(4, error=error)):
        back = ControlReply.from_frames(reply.to_frames())
        assert back.call_id == reply.call_id and back.error == reply.error
        assert json.dumps(back.result) == json.dumps(reply.result)


def test_calls_hold_their_arguments_as_checked_once_where_built():
    dist = calls.UpdateWeightsFromDistributed(["a"], [torch.float16], [[2, 2]])
    assert (dist.dtypes, dist.shapes) == (("float16",), ((2, 2),))
    assert calls.ReleaseMemoryOccupation(None).tags == ("weights", "kv_cache", "cuda_graph")
    assert calls.InitWeightsUpdateGroup("h", 1, 1, 2, timeout_s=5).timeout_s == 5.0
    with pytest.raises(ValueError, match="mode must be one of abort, retract, in_place"):
        calls.PauseGeneration("sideways")
    with pytest.raises(ValueError, match="give rid, or abort_all: true"):
        AbortRequest()
    with pytest.raises(TypeError, match="abort_all must be a bool"):
        AbortRequest("r", abort_all="yes")
    with pytest.raises(ValueError, match="format"):
        calls.UpdateWeightsFromTensor({"format": "pickle", "data": "gASV"})


def _distributed(flush_cache):
    return calls.UpdateWeightsFromDistributed(["a"], ["float32"], [[2]], flush_cache=flush_cache)


def _tensor(flush_cache):
    with calls.UpdateWeightsFromTensor.shared({"a": torch.zeros(2)}, flush_cache=flush_cache) as c:
        return c


@pytest.mark.parametrize("build", [_distributed, _tensor])
def test_flush_cache_is_a_bool_either_value_accepted(build):
    assert build(True).flush_cache is True
    assert build(False).flush_cache is False  # SGLang trainers send False on every bucket
    with pytest.raises(TypeError, match="flush_cache must be a bool"):
        build(1)


def test_tensor_load_format_is_checked_not_ignored():
    sent = share_tensors([("w", torch.zeros(2))])
    for ok in (None, "flattened_bucket"):  # the handles carry the layout: both load alike
        assert calls.UpdateWeightsFromTensor(sent.handles, ok).load_format == ok
    with pytest.raises(ValueError, match="load_format must be None or flattened_bucket"):
        calls.UpdateWeightsFromTensor(sent.handles, "safetensors")
    sent.close()


# ---- one kind per failure: one Python exception, one HTTP status ------------------------------
KINDS = [
    ("invalid", ValueError, 400),
    ("forbidden", PermissionError, 403),
    ("weight_sync", WeightSyncError, 502),
    ("internal", RuntimeError, 500),
]


@pytest.mark.parametrize("kind, python, status", KINDS, ids=[k[0] for k in KINDS])
def test_a_failure_kind_is_the_same_exception_in_the_engine_and_the_client(kind, python, status):
    raised = ControlError(kind, "what went wrong").exception()
    assert isinstance(raised, python) and "what went wrong" in str(raised)
    assert ControlError.of(raised).kind == kind
    over_http = _exception(status, "what went wrong")
    assert isinstance(over_http, python) and "what went wrong" in str(over_http)


def _raising_engine(exc: Exception) -> SimpleNamespace:
    """A stand-in engine whose get_server_info raises `exc`."""

    def get_server_info() -> dict:
        raise exc

    model = SimpleNamespace(model_path="stand-in")
    return SimpleNamespace(options=SimpleNamespace(model=model), get_server_info=get_server_info)


@pytest.mark.parametrize(
    "exc, status",
    [
        (InvalidRequest("top_p must be in (0, 1], got 1.5"), 400),
        (InvalidRequestType("prompt must be a str"), 400),
        (Forbidden("model_path is not under an allowed root"), 403),
        (WeightSyncError("the trainer left"), 502),
        (ValueError("int() of a bug"), 500),
        (TypeError("a bug: missing argument"), 500),
        (PermissionError("a bug: no such file access"), 500),
    ],
)
def test_only_the_projects_validation_errors_are_4xx(exc, status):
    app = create_app(_raising_engine(exc), ServerOptions())
    with TestClient(app, raise_server_exceptions=False) as client:
        resp = client.get("/get_server_info")
    assert resp.status_code == status
    message = resp.json()["error"]["message"]
    if status == 500:  # a bug: the caller gets an error id, the log the trace
        assert "error id" in message and str(exc) not in message
    else:
        assert message == str(exc)


def test_weight_sync_never_imports_the_engine_or_the_server():
    code = (
        "import sys, rollout.weight_sync.controller, rollout.weight_sync.sender, "
        "rollout.weight_sync.calls\n"
        "print(sorted(m for m in sys.modules if m.startswith(('rollout.engine', 'rollout.server'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- through a running engine, in Python and over HTTP ---------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cpu", max_total_tokens=4096) as eng:
        yield eng


@pytest.fixture(scope="module")
def http(engine):
    with TestClient(create_app(engine, ServerOptions()), raise_server_exceptions=False) as c:
        yield c


def test_a_refused_update_changes_nothing_and_says_why(engine, http):
    version = engine.get_weight_version()
    norm = engine.get_weights_by_name(NORM)
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.update_weights_from_tensor({NORM: torch.zeros(len(norm) + 1)})
    sent = share_tensors([(NORM, torch.zeros(len(norm)))])
    body = {"tensor_handles": sent.handles.to_json(), "weight_version": "refused"}
    for extra, message in [
        ({"serialized_named_tensors": ["AAAA"]}, "exactly one of tensor_handles and serialized_named_tensors"),
        ({"load_format": "safetensors"}, "load_format must be None or flattened_bucket"),
    ]:
        resp = http.post("/update_weights_from_tensor", json={**body, **extra})
        assert resp.status_code == 400 and message in resp.json()["error"]["message"]
    sent.close()
    assert engine.get_weight_version() == version and engine.get_weights_by_name(NORM) == norm


def test_the_schedulers_answers_come_back_typed(engine, http):
    """A refusal found in the scheduler process crosses back as its kind: the same exception
    as one found where the call was built, and the same status over HTTP."""
    with pytest.raises(InvalidRequest, match="unknown weight name 'model.nope'"):
        engine.get_weights_by_name("model.nope")
    resp = http.post("/get_weights_by_name", json={"name": "model.nope"})
    assert (resp.status_code, resp.json()["error"]["type"]) == (400, "invalid_request_error")
    resp = http.post("/resume_memory_occupation", json={"tags": ["gpu"]})
    assert resp.status_code == 400 and "memory tags must be among" in resp.text
    assert engine.get_server_info()["weight_version"] == engine.get_weight_version()
    assert engine.flush_cache() == {"success": True, "message": ""}
    assert httpx.codes.is_success(http.post("/flush_cache").status_code)
    assert http.post("/abort_request", json={}).status_code == 400
    assert http.post("/abort_request", json={"rid": "nobody"}).json() == {"success": True}
