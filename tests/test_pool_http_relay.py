"""`rollout router`'s relay of /generate (rollout/pool/generate_relay.py) over stand-in workers
(aiohttp.web, no engine), served as the router serves it: the client's body reaches a worker as
it was sent and the worker's answer comes back byte for byte; a retry on another worker says
so; a worker's refusal comes back as the router's own; what is not relayed takes the app's
path, its errors counted once."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from relay_helpers import ANSWER, EVENTS, USER_HEADERS, WORKER_KEY, router_app, stand_in_workers

from rollout.pool.generate_relay import relay_front, until_disconnect
from rollout.pool.requests import relay_part
from rollout.server.streaming import ClientDisconnected


@pytest.fixture
def workers():
    with stand_in_workers() as made:
        yield made


@contextlib.asynccontextmanager
async def router(workers):
    """An httpx client of the router's ASGI app (relay_front over the app) over `workers`."""
    async with router_app(workers) as (app, dispatcher, options):
        transport = httpx.ASGITransport(app=relay_front(app, dispatcher, options))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://router", headers=USER_HEADERS
        ) as client:
            client.routing = dispatcher.router
            client.metrics = app.state.metrics
            yield client


def _errors(client) -> dict[tuple[str, ...], float]:
    counted = {}
    for metric in client.metrics.errors.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                labels = sample.labels
                counted[(labels["status_class"], labels["type"])] = sample.value
    return counted


def test_the_body_and_the_answer_pass_byte_for_byte(workers):
    # Keys in an odd order, with spaces: what a worker gets is what the client sent.
    sent = b'{"sampling_params": {"max_new_tokens": 1},  "input_ids": [5, 6, 7], "rid": "r-1"}'

    async def run():
        async with router(workers) as client:
            answer = await client.post("/generate", content=sent)
            assert answer.status_code == 200 and answer.content == ANSWER
            assert answer.headers["content-type"] == "application/json"
            assert answer.headers["x-rollout-replica"] == "0"  # the worker that answered
            unauthorized = await client.post(
                "/generate", content=sent, headers={"Authorization": ""}
            )
            assert unauthorized.status_code == 401
            return client.routing.stats()

    stats = asyncio.run(run())
    assert [w.bodies for w in workers] == [[sent], []]  # the 401 reached no worker
    assert workers[0].auth == [f"Bearer {WORKER_KEY}"]
    assert stats[0]["routed"] == 1 and stats[0]["load_tokens"] == 0 and stats[0]["in_flight"] == 0


def test_a_request_whose_worker_died_is_retried_and_says_so(workers):
    workers[0].dead = True
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}

    async def run():
        async with router(workers) as client:
            answer = await client.post("/generate", json=body)
            streamed = await client.post("/generate", json={**body, "stream": True})
            return answer, streamed, client.routing.stats()

    answer, streamed, stats = asyncio.run(run())
    assert answer.status_code == 200
    assert answer.headers["x-rollout-replica"] == "1"  # the retry's worker, not the dead one
    assert answer.json() == {**json.loads(ANSWER), "meta_info": {"id": "w", "x": -float("inf"),
                                                                  "retried": True}}  # fmt: skip
    assert len(workers[0].bodies) == 1 and len(workers[1].bodies) == 2
    assert stats[0]["deaths"] == 1 and stats[0]["retried_elsewhere"] == 1
    # Worker 0 was marked dead by the first request: the stream went to worker 1 alone.
    events = [e for e in streamed.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == len(EVENTS) + 1


def test_a_stream_passes_event_by_event_and_an_error_event_ends_it(workers):
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "stream": True}

    async def run():
        async with router(workers) as client:
            plain = await client.post("/generate", json=body)
            failed = await client.post("/generate", json={**body, "rid": "midstream-error"})
            return plain, failed, _errors(client)

    plain, failed, errors = asyncio.run(run())
    assert plain.content == b"".join(EVENTS) + b"data: [DONE]\n\n"
    assert plain.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = [e for e in failed.text.split("\n\n") if e]
    assert events[:2] == [e.decode().strip() for e in EVENTS] and events[-1] == "data: [DONE]"
    error = json.loads(events[2][len("data: ") :])["error"]
    assert error["code"] == 500 and "the engine failed" in error["message"]
    assert errors == {("5xx", "server_error"): 1.0}


@pytest.mark.parametrize(
    "rid, status, kind, message",
    [("400", 400, "invalid_request_error", "refused with 400"),
     ("500", 500, "server_error", "refused with 500"),
     ("401", 403, "permission_error", "refused the router's key")],
)  # fmt: skip
def test_a_workers_refusal_comes_back_with_its_message(workers, rid, status, kind, message):
    async def run():
        async with router(workers) as client:
            answer = await client.post("/generate", json={"input_ids": [1], "rid": rid})
            return answer, _errors(client)

    answer, errors = asyncio.run(run())
    assert answer.status_code == status
    error = answer.json()["error"]
    assert error["type"] == kind and message in error["message"] and error["code"] == status
    assert errors == {(f"{status // 100}xx", kind): 1.0}  # counted once


@pytest.mark.parametrize("rid", [123, {"r": 1}, 1.5, [7]])
def test_a_rid_that_is_no_string_is_refused_by_the_router_itself(workers, rid):
    async def run():
        async with router(workers) as client:
            answer = await client.post("/generate", json={"input_ids": [1, 2], "rid": rid})
            return answer, _errors(client)

    answer, errors = asyncio.run(run())
    assert answer.status_code == 400 and "rid" in answer.json()["error"]["message"]
    assert errors == {("4xx", "invalid_request_error"): 1.0}
    assert [w.bodies for w in workers] == [[], []]


def test_a_batch_and_a_bad_body_take_the_apps_path(workers):
    async def run():
        async with router(workers) as client:
            batch = await client.post("/generate", json={"input_ids": [[1, 2], [3, 4]]})
            bad = await client.post("/generate", json={"input_ids": [1], "bogus": 1})
            not_json = await client.post("/generate", content=b"{not json")
            return batch, bad, not_json, _errors(client)

    batch, bad, not_json, errors = asyncio.run(run())
    assert [o["output_ids"] for o in batch.json()] == [[1, 2], [3, 4]]  # split over both
    assert all(len(w.bodies) == 1 for w in workers)
    assert bad.status_code == 400 and "bogus" in bad.json()["error"]["message"]
    assert not_json.status_code == 400
    assert errors == {("4xx", "invalid_request_error"): 2.0}  # each counted once


def test_which_bodies_are_relayed():
    def relayed(body: dict) -> bool:
        return relay_part(body, json.dumps(body).encode()) is not None

    assert relayed({"input_ids": [1, 2], "sampling_params": {"n": 4}})
    assert relayed({"text": "a prompt", "stream": True, "rid": "r"})
    assert relayed({"input_ids": [[1, 2]]})  # a batch of one: its answer is a list of one
    assert relayed({"input_ids": [[1, 2]], "rid": ["r"]})
    assert relayed({"input_ids": [7]}) and relayed({"input_ids": [7], "stream": True})  # one token
    assert not relayed({"input_ids": [1, 2], "rid": 7})  # the app refuses it
    assert not relayed({"input_ids": [[1, 2], [3]]})  # a batch: split over the workers
    assert not relayed({"text": ["a", "b"]})
    assert not relayed({"input_ids": [1, 2], "stream": True, "sampling_params": {"n": 2}})
    assert not relayed({"input_ids": [[1, 2]], "stream": True})  # streamed with an index
    assert not relayed({"input_ids": [1], "stream": 1})  # the app refuses or converts it
    assert not relayed({"input_ids": [1], "bogus": True})
    assert not relayed({"sampling_params": {}})  # no prompt


def test_a_client_that_leaves_cancels_its_request(monkeypatch):
    import rollout.pool.generate_relay as relay

    monkeypatch.setattr(relay, "WATCH_AFTER_S", 0.0)

    async def run():
        cancelled = asyncio.Event()

        async def receive():
            return {"type": "http.disconnect"}

        async def work(turns: int):
            try:
                for _ in range(turns):
                    await asyncio.sleep(0)
                return "done"
            finally:
                cancelled.set()

        with pytest.raises(ClientDisconnected):
            await until_disconnect(receive, work(100))
        assert cancelled.is_set()
        # Done about when the client leaves: an answer stands (or the request counts as left),
        # and nothing cancels this task later.
        outcomes = set()
        for turns in range(6):
            try:
                outcomes.add(await until_disconnect(receive, work(turns)))
            except ClientDisconnected:
                outcomes.add("left")
            await asyncio.sleep(0.01)
        assert outcomes == {"done", "left"}

    asyncio.run(run())


def _counted(metrics) -> dict:
    """The request, finish and token counters of a ServerMetrics (not the latencies)."""
    counted = {}
    for metric in (metrics.requests, metrics.finishes, metrics.prompt_tokens,
                   metrics.generated_tokens, metrics.cached_tokens):  # fmt: skip
        for family in metric.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counted[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return counted


def test_a_relayed_answers_metrics_are_read_from_its_bytes_as_parsing_would_count_them():
    from rollout.pool.generate_relay import observe_answer
    from rollout.server.metrics import ServerMetrics

    def output(reason, prompt, completion, cached, text="a"):
        meta = {"id": "x", "prompt_tokens": prompt, "completion_tokens": completion,
                "cached_tokens": cached, "finish_reason": reason, "weight_version": "v1",
                "output_token_logprobs": [[-0.5, 7, None]] * 3}  # fmt: skip
        return {"text": text, "output_ids": [7, 8], "meta_info": meta}

    # Text that holds the keys themselves, escaped as JSON escapes them in a string.
    tricky = 'say "prompt_tokens": 99, "finish_reason": {"type": "stop"} and \\"cached_tokens\\": 5'
    answers = [
        output({"type": "length", "length": 16}, 12, 16, 4),
        [output({"type": "stop", "matched": "}\""}, 5, 3, 0, tricky),
         output(None, 5, 0, 5), output({"type": "abort", "message": "x"}, 5, 1, 0)],
        output({"matched": 2, "type": "stop"}, 1, 1, 0),  # type not first: counted as unknown
    ]  # fmt: skip
    for compact in (True, False):
        parsed, scanned = ServerMetrics(), ServerMetrics()
        for answer in answers:
            body = json.dumps(answer, separators=(",", ":") if compact else None).encode()
            observe_answer(scanned, body, 0.0)
            outs = json.loads(body)
            parsed.observe("generate", outs if isinstance(outs, list) else [outs], 0.0)
        expected = _counted(parsed)
        finish = "rollout_finish_reasons_total"
        expected[(finish, (("endpoint", "generate"), ("reason", "unknown")))] += 1
        expected[(finish, (("endpoint", "generate"), ("reason", "stop")))] -= 1
        assert _counted(scanned) == expected
