"""Large JSON bodies in bounded pieces (issue 18): json_parse reads a body as json.loads does,
to the value and to the error, in pieces small enough to let the event loop run between them;
json_release frees a parsed body a piece at a time, and only what nothing else holds; the
routes hand a large body's parts to it once the answer is sent."""

from __future__ import annotations

import gc
import json
import math
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict

import rollout.server.json_body as json_body
import rollout.server.json_parse as json_parse
import rollout.server.json_release as json_release
from rollout.engine.worker_calls import run_in
from rollout.errors import InvalidRequest
from rollout.server.app import create_app
from rollout.server.json_body import LARGE_BODY_BYTES, collections_paused
from rollout.server.json_collection_pause import CollectionPause
from rollout.server.json_parse import TooManyContainers, decode_body, parse
from rollout.server.json_release import release
from rollout.server.options import ServerOptions


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of a few characters, so that short texts cross many cuts."""
    monkeypatch.setattr(json_parse, "PIECE_CHARS", 7)
    monkeypatch.setattr(json_parse, "_FIRST_PIECE_CHARS", 5)
    monkeypatch.setattr(json_parse, "STRING_PIECE_CHARS", 40)
    monkeypatch.setattr(json_parse, "_FIRST_STRING_PIECE_CHARS", 30)
    monkeypatch.setattr(json_parse, "DECODE_PIECE_BYTES", 7)


def _outcome(loads: Any, text: str) -> tuple:
    try:
        return ("value", loads(text))
    except json.JSONDecodeError as e:
        return ("JSONDecodeError", e.msg, e.pos)
    except (ValueError, RecursionError) as e:
        return (type(e).__name__,)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


def _assert_parses_as_json_loads(text: str) -> None:
    want, got = _outcome(json.loads, text), _outcome(parse, text)
    if want[0] == got[0] == "value":
        assert _same(got[1], want[1]), text[:200]
    else:
        assert got == want, text[:200]


ESCAPES = '\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\ud83d\\ude00\\ud800\\udc00\\uDBFF\\uDFFF'
CASES = [
    '{"a": [1, 2.5, -0, -0.0, 1e5, -1.5E-3, 10000000000000000000000, true, false, null]}',
    '{"b": {}, "c": [], "d": [[], {}, [[]]], "e": ""}',
    '{"a": 1, "b": 2, "a": 3, "c": {"x": 1, "x": [2]}}',
    "[NaN, Infinity, -Infinity]",
    "  [ 1 ,\n 2\t,\r3 ] ",
    '{ "a" : 1 , "b" :\n"2" }',
    '["caf\u00e9 \u2603 \U0001f600", "\ud800"]',
    '"' + ESCAPES * 9 + '"',
    '["' + '","'.join(ESCAPES[:i] for i in range(0, len(ESCAPES), 3)) + '"]',
    '"' + "\\\\" * 57 + '"',
    '"' + "x\\\\" * 30 + "\\u0041" * 20 + '"',
    '["a,b", "c\\",d", ",", "\\\\", "]", "[{", "},"]',
    '[[1, 2], [3, [4, [5, "6,7"]]], {"k": [8, {"l": 9}]}]',
    "[" * 50 + "]" * 50,
    # Errors: json's message and position.
    "[1, 2,]",
    '{"a": 1,}',
    "[1 2]",
    '{"a" 1}',
    "{a: 1}",
    '"abc',
    '"a\\x"',
    '"\\u12"',
    '"\x01"',
    '["' + "y" * 100 + "\x1f" + '"]',
    "[",
    "",
    "   ",
    "1 2",
    "nul",
    "[-]",
    "[01]",
    "[1.]",
    "[1e]",
    "[\u0661]",  # not an ASCII digit
    "\ufeff[]",
    "[" + "9" * 5000 + "]",  # beyond int's digit limit: json's ValueError
    '{"a": [1, 2, 3' + ", 4" * 40,
    '{"a": "' + "z" * 100,
]


@pytest.mark.parametrize("text", CASES)
def test_parse_gives_json_loads_value_or_error(small_pieces, text):
    _assert_parses_as_json_loads(text)


def _random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.random()
    if depth > 3 or kind < 0.5:
        return rng.choice(
            [
                None, True, False, rng.randrange(-10**6, 10**6), rng.randrange(10**30), 0.5,
                -1e300, 1.5e-7, math.inf,
                "".join(rng.choice('ab,[]{}:"\\/\n\t\x00\u00e9\u2603\U0001f600\ud800 ') for _ in range(rng.choice([0, 1, 5, 60]))),
            ]
        )  # fmt: skip
    size = rng.choice([0, 1, 3, 20])
    if kind < 0.75:
        return [_random_value(rng, depth + 1) for _ in range(size)]
    return {
        str(rng.random())[: rng.randrange(1, 6)]: _random_value(rng, depth + 1) for _ in range(size)
    }


def _mutated(rng: random.Random, text: str) -> str:
    chars = list(text)
    for _ in range(rng.choice([1, 2, 3])):
        i = rng.randrange(len(chars) + 1)
        op = rng.randrange(3)
        if op == 0 and chars:
            del chars[min(i, len(chars) - 1)]
        else:
            chars.insert(i, rng.choice('"\\,[]{}: a1-.eunt0\x01\u00e9'))
    return "".join(chars)


def test_parse_agrees_with_json_loads_on_random_documents(small_pieces):
    rng = random.Random(0)
    for _ in range(300):
        value = _random_value(rng, 0)
        text = json.dumps(
            value,
            ensure_ascii=rng.random() < 0.5,
            indent=rng.choice([None, None, 1]),
            separators=rng.choice([None, (",", ":"), (" , ", " : ")]),
        )
        _assert_parses_as_json_loads(text)
        for _ in range(3):
            _assert_parses_as_json_loads(_mutated(rng, text))


@pytest.mark.parametrize(
    "encoding", ["utf-8", "utf-8-sig", "utf-16-le", "utf-16-be", "utf-16", "utf-32"]
)
def test_decode_body_decodes_as_json_loads_does(small_pieces, encoding):
    text = '{"t": "caf\u00e9 \u2603 \U0001f600 ' + "\u00e9\U0001f600x" * 40 + '"}'
    body = text.encode(encoding)
    assert decode_body(body) == body.decode(json.detect_encoding(body), "surrogatepass")
    assert parse(decode_body(body)) == json.loads(body)


def test_a_body_of_too_many_arrays_and_objects_is_refused(small_pieces, monkeypatch):
    monkeypatch.setattr(json_parse, "MAX_CONTAINERS", 10)
    nine = "[" + ",".join(["[]"] * 4 + ["{}"] * 4) + "]"
    assert len(parse(nine)) == 8
    brackets_in_strings = '[["[[[[", "{{{{"], {"[": "{"}' + ', "[]"' * 20 + ", []]"
    assert len(parse(brackets_in_strings)) == 23
    with pytest.raises(TooManyContainers, match="more than 10 arrays and objects"):
        parse("[" + ",".join(["[]"] * 10) + "]")


# ---- freeing -------------------------------------------------------------------------------
class _Spy:
    """Records whether release was running when it was freed."""

    releasing = False
    freed: list[bool] = []

    def __del__(self) -> None:
        _Spy.freed.append(_Spy.releasing)


class _Holder(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    items: list[Any]


def test_release_frees_everything_nothing_else_holds(monkeypatch):
    monkeypatch.setattr(json_release, "PIECE_ITEMS", 3)
    _Spy.freed = []
    value = {
        "flat": [_Spy() for _ in range(10)],
        "nested": [[_Spy(), [_Spy(), {"x": _Spy()}]] for _ in range(5)],
        "model": _Holder(items=[_Spy() for _ in range(7)]),
        "members": {str(i): _Spy() for i in range(8)},
    }
    owned = [value]
    del value
    _Spy.releasing = True
    release(owned)
    _Spy.releasing = False
    assert owned == []
    assert _Spy.freed == [True] * (10 + 5 * 3 + 7 + 8)  # each one, while release ran


def test_release_leaves_what_something_else_holds():
    shared = list(range(100))
    kept_model = _Holder(items=[1, 2, 3])
    kept_dict = {"a": [1], "b": [2]}
    owned = [{"x": shared, "y": [shared, kept_dict], "z": [kept_model], "w": list(range(50))}]
    release(owned)
    assert shared == list(range(100))
    assert kept_model.items == [1, 2, 3]
    assert kept_dict == {"a": [1], "b": [2]}


def test_a_failed_parse_hands_what_it_read_to_release(monkeypatch, small_pieces):
    seen: list[int] = []

    def counting_release(values: list) -> None:
        seen.extend(sys.getrefcount(v) for v in values)
        release(values)

    monkeypatch.setattr(json_parse, "release", counting_release)
    counting_release([[1, 2]])  # the count where the list alone holds it
    alone = seen.pop()
    with pytest.raises(json.JSONDecodeError):
        parse('{"a": [[1, 2], [3, 4], [5, "' + "x" * 100 + '", 6,]]}')
    assert seen == [alone] * 3  # the object and two unfinished arrays, held by nothing else
    with pytest.raises(json.JSONDecodeError, match="Extra data"):
        parse("[1, 2, 3] 4")
    assert seen[-1] == alone


def test_collections_pause_nests_and_restores():
    assert gc.isenabled()
    with collections_paused():
        with collections_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_collection_pause_ends_after_its_bound_even_with_a_body_alive():
    pause = CollectionPause(max_pause_s=0.01)
    pause.hold()
    try:
        deadline = time.monotonic() + 30
        while not gc.isenabled() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gc.isenabled() and pause.holders == 1
        pause.hold()  # a body that comes while one is alive starts no new pause
        assert gc.isenabled()
        pause.let_go()
    finally:
        pause.let_go()
    assert gc.isenabled()
    with pause():  # the next one pauses again
        assert not gc.isenabled()
    assert gc.isenabled()


# ---- the routes ----------------------------------------------------------------------------
class _KeepingEngine:
    """Keeps the input ids of the request it answers, as an engine may."""

    options = SimpleNamespace(model=SimpleNamespace(model_path="m", is_embedding=False))
    tokenizer = None

    def __init__(self) -> None:
        self.kept: list | None = None

    def is_alive(self) -> bool:
        return True

    async def async_generate(self, request: Any) -> dict:
        self.kept = request.input_ids
        return {"text": "", "output_ids": [], "meta_info": {"id": "r", "finish_reason": None}}


def test_a_large_body_is_released_after_the_answer_but_not_what_the_engine_keeps(monkeypatch):
    released: list[str] = []

    def recording_release(values: list) -> None:
        released.extend(type(v).__name__ for v in values)
        release(values)

    monkeypatch.setattr(json_body, "release", recording_release)
    engine = _KeepingEngine()
    ids = list(range(LARGE_BODY_BYTES // 4))
    with TestClient(create_app(engine, ServerOptions()), raise_server_exceptions=False) as client:
        resp = client.post("/generate", content=json.dumps({"input_ids": ids}))
    assert resp.status_code == 200, resp.text[:300]
    # The parsed dict after validation, then the validated model once the answer was sent.
    assert released == ["dict", "GenerateBody"]
    assert engine.kept == ids


def test_a_large_body_of_too_many_arrays_gets_a_400(monkeypatch):
    monkeypatch.setattr(json_parse, "MAX_CONTAINERS", 1000)
    body = json.dumps({"input_ids": [[1, 2, 3]] * 2000, "text": "x" * LARGE_BODY_BYTES})
    with TestClient(
        create_app(_KeepingEngine(), ServerOptions()), raise_server_exceptions=False
    ) as client:
        resp = client.post("/generate", content=body)
    assert resp.status_code == 400
    assert (
        resp.json()["error"]["message"] == "the JSON body holds more than 1000 arrays and objects"
    )


class _ValidatingEngine(_KeepingEngine):
    """Checks a request as the engine does, on the event loop here (no tokenizer needed)."""

    async def async_generate(self, request: Any) -> dict:
        from rollout.config import RequestOptions
        from rollout.engine.request_limits import RequestLimits
        from rollout.engine.request_validation import build_inputs

        build_inputs(None, RequestLimits(64, RequestOptions()), request)
        return await super().async_generate(request)

    async def run_in_worker(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": [None] * 100_000}),
    ("/generate", {"text": ["a", 3]}),
    ("/v1/completions", {"model": "m", "prompt": [None] * 100_000}),
    ("/v1/completions", {"model": "m", "prompt": [[1, 2], "a", {"x": 1}]}),
])  # fmt: skip
def test_prompt_lists_are_checked_by_the_engine_not_item_by_item_by_pydantic(path, body):
    # pydantic would make one error per bad item, holding the event loop throughout; the engine
    # refuses the list at its first bad item, on a worker thread.
    app = create_app(_ValidatingEngine(), ServerOptions())
    app.state.model_name = "m"
    with TestClient(app, raise_server_exceptions=False) as client:
        resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text[:300]
    message = resp.json()["error"]["message"]
    assert any(why in message for why in ("must be a str", "prompt must be", "at most 16384 samples"))


class _GcWatchingEngine(_KeepingEngine):
    """Notes whether automatic collections were on while it held the request."""

    async def async_generate(self, request: Any) -> dict:
        self.collecting = gc.isenabled()
        return await super().async_generate(request)


def test_no_collection_runs_while_a_large_body_lives():
    # A collection would walk each of the body's items, holding the event loop.
    engine = _GcWatchingEngine()
    ids = list(range(LARGE_BODY_BYTES // 4))
    with TestClient(create_app(engine, ServerOptions()), raise_server_exceptions=False) as client:
        resp = client.post("/generate", content=json.dumps({"input_ids": ids}))
        assert resp.status_code == 200, resp.text[:300]
        assert engine.collecting is False
        assert gc.isenabled() and collections_paused.holders == 0


class _RefusingEngine(_KeepingEngine):
    """Refuses a request from a worker thread whose frames hold it, as the engine's checks do."""

    def __init__(self) -> None:
        super().__init__()
        self.workers = ThreadPoolExecutor(1)

    async def async_generate(self, request: Any) -> dict:
        def check(request: Any) -> None:
            raise InvalidRequest(f"input_ids has {len(request.input_ids)} tokens: too many")

        await run_in(self.workers, check, request)
        raise AssertionError("unreachable")


def test_a_refused_large_body_is_held_by_its_model_alone_when_released(monkeypatch):
    # Anything else that held it then (an error's frames, a future's result) would free it in
    # one piece later, wherever that holder goes: often on the event loop, or in a collection.
    held: list[tuple[int, int]] = []

    def recording_release(values: list) -> None:
        for v in values:
            if isinstance(v, BaseModel):
                held.append((sys.getrefcount(v), sys.getrefcount(v.__dict__["input_ids"])))
        release(values)

    monkeypatch.setattr(json_body, "release", recording_release)
    ids = [str(i) for i in range(LARGE_BODY_BYTES // 8)]
    app = create_app(_RefusingEngine(), ServerOptions())
    with TestClient(app, raise_server_exceptions=False) as client:
        for _ in range(3):
            resp = client.post("/generate", content=json.dumps({"input_ids": ids}))
            assert resp.status_code == 400, resp.text[:300]
            assert "too many" in resp.json()["error"]["message"]
    recording_release([_model_of(ids)])  # held by the released list alone
    alone = held.pop()
    assert held == [alone] * 3


def _model_of(ids: list) -> BaseModel:
    model = _Holder(items=[])
    model.__dict__["input_ids"] = list(ids)
    return model


class _LargeModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[int]


def test_a_request_that_outlives_its_answer_does_not_keep_its_large_body(monkeypatch):
    # A task that watches for a disconnect may still hold the request when the body is
    # released; the body would then be freed in one piece when that task ends.
    released: list[int] = []

    def recording_release(values: list) -> None:
        released.extend(sys.getrefcount(v) for v in values)
        release(values)

    monkeypatch.setattr(json_body, "release", recording_release)
    kept: list[Request] = []
    router = APIRouter(route_class=json_body.OffLoopRoute)

    @router.post("/items")
    async def items(body: _LargeModel, request: Request) -> dict:
        kept.append(request)
        return {"n": len(body.items)}

    app = FastAPI()
    app.include_router(router)
    n = LARGE_BODY_BYTES // 4
    with TestClient(app) as client:
        body = json.dumps({"items": list(range(n))})
        resp = client.post("/items", content=body, headers={"content-type": "application/json"})
    assert resp.json() == {"n": n}
    recording_release([_LargeModel(items=[])])  # a model held by the released list alone
    alone = released.pop()
    assert released[-1:] == [alone]  # the validated model, released after the answer
    assert kept and "_json" not in kept[0].__dict__
