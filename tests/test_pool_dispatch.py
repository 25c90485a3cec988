"""Retries of the pool's dispatcher on fake replicas (no Ray, no engines): a request whose
replica dies runs once more elsewhere and says so; a second death, or a death after a stream
sent outputs, fails clearly; refusals are never retried."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rollout.engine.tokenizer_manager import EngineDeadError
from rollout.errors import InvalidRequest
from rollout.generate_request import GenerateRequest
from rollout.pool.dispatch import Dispatcher
from rollout.pool.replica import Replica, ReplicaDead
from rollout.pool.router import Router
from rollout.pool.supervisor import Supervisor


class FakeReplica(Replica):
    restartable = False  # stays down: the tests look at what happened to the requests

    def __init__(self, index: int, fate: str = "serve") -> None:
        self.index, self.name, self.fate = index, f"replica {index}", fate
        self.served: list[Any] = []

    async def start(self) -> dict:
        return {}

    async def generate(self, request: GenerateRequest) -> Any:
        if self.fate == "die":
            raise ReplicaDead(f"{self.name} died")
        if self.fate == "refuse":
            raise InvalidRequest("top_p must be in (0, 1]")
        self.served.append(request.input_ids)
        return [{"output_ids": [self.index], "meta_info": {}}]

    async def stream(self, request: GenerateRequest) -> AsyncIterator[dict]:
        yield {"output_ids": [self.index], "meta_info": {}}
        if self.fate == "die":
            raise ReplicaDead(f"{self.name} died")

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.fate == "die":
            raise ReplicaDead(f"{self.name} died")
        self.served.append((method, args))
        if method == "open_session":
            return args[1] or f"s-{self.index}"
        return {"replica": self.index}

    async def alive(self) -> bool:
        return self.fate != "die"

    async def stop(self) -> None:
        pass


def _dispatcher(*fates: str) -> tuple[list[FakeReplica], Supervisor, Dispatcher]:
    replicas = [FakeReplica(i, fate) for i, fate in enumerate(fates)]
    router = Router(len(replicas))
    sup = Supervisor(replicas, router, health_check_s=0)
    return replicas, sup, Dispatcher(sup, router, wait_s=0.5)


def test_a_request_whose_replica_dies_is_retried_once_elsewhere():
    async def run() -> None:
        replicas, sup, dispatcher = _dispatcher("die", "serve")
        await sup.start_all()
        request = GenerateRequest(input_ids=[[1, 2], [3, 4], [5, 6]])
        outs = await dispatcher.generate(request)
        assert [o["output_ids"] for o in outs] == [[1]] * 3  # all answered, in order
        assert [o["meta_info"].get("retried", False) for o in outs] == [True, False, False]
        assert sup.state[0] != "serving" and replicas[1].served == [[[1, 2]], [[3, 4]], [[5, 6]]]
        stats = dispatcher.router.stats()
        assert stats[0]["deaths"] == 1 and stats[0]["retried_elsewhere"] == 1

    asyncio.run(run())


def test_a_second_death_or_no_replica_fails_clearly():
    async def run() -> None:
        _, sup, dispatcher = _dispatcher("die", "die")
        await sup.start_all()
        with pytest.raises(EngineDeadError, match="already been retried once"):
            await dispatcher.generate(GenerateRequest(input_ids=[1, 2]))
        with pytest.raises(EngineDeadError, match="no replica of the pool is serving"):
            await dispatcher.generate(GenerateRequest(input_ids=[1, 2]))

    asyncio.run(run())


def test_a_stream_that_already_sent_outputs_is_not_retried():
    async def run() -> None:
        _, sup, dispatcher = _dispatcher("die", "serve")
        await sup.start_all()
        seen = []
        with pytest.raises(EngineDeadError, match="outputs were already sent"):
            async for out in dispatcher.stream(GenerateRequest(input_ids=[1, 2], stream=True)):
                seen.append(out)
        assert len(seen) == 1

    asyncio.run(run())


def test_a_refusal_is_raised_as_it_is_and_not_retried():
    async def run() -> None:
        replicas, sup, dispatcher = _dispatcher("refuse", "serve")
        await sup.start_all()
        with pytest.raises(InvalidRequest, match="top_p"):
            await dispatcher.generate(GenerateRequest(input_ids=[1, 2]))
        assert replicas[1].served == [] and sup.serving() == [0, 1]

    asyncio.run(run())


def test_encode_classify_and_score_go_to_the_least_loaded_replica_and_are_retried_once():
    async def run() -> None:
        replicas, sup, dispatcher = _dispatcher("serve", "serve", "die")
        await sup.start_all()
        dispatcher.router.started(0, 500)  # replica 0 has work outstanding
        for method in ("encode", "classify", "score"):
            assert await dispatcher.call_one(method, "a prompt") == {"replica": 1}
        dispatcher.router.finished(0, 400)
        dispatcher.router.started(1, 500)
        # Replica 2 is now the least loaded: it dies, and the call runs on replica 0.
        assert await dispatcher.call_one("encode", "again") == {"replica": 0}
        assert [m for m, _ in replicas[1].served] == ["encode", "classify", "score"]
        assert sup.state[2] != "serving"

    asyncio.run(run())


def test_two_opens_of_one_session_id_at_once_open_it_once():
    async def run() -> None:
        replicas, sup, dispatcher = _dispatcher("serve", "serve")
        await sup.start_all()
        for replica in replicas:  # opening takes a while, as on a real replica
            replica.call = _slowly(replica.call)
        first, second = await asyncio.gather(
            dispatcher.open_session(4096, "chat-2"),
            dispatcher.open_session(4096, "chat-2"),
            return_exceptions=True,
        )
        assert first == "chat-2"
        assert isinstance(second, InvalidRequest) and "already open" in str(second)
        opens = [args for r in replicas for method, args in r.served if method == "open_session"]
        assert opens == [(4096, "chat-2")]
        await dispatcher.close_session("chat-2")
        assert await dispatcher.open_session(4096, "chat-2") == "chat-2"  # closed: may open again

    asyncio.run(run())


def _slowly(call):
    async def slow(method: str, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.01)
        return await call(method, *args, **kwargs)

    return slow


def test_a_sessions_turns_all_go_to_the_replica_that_opened_it():
    async def run() -> None:
        replicas, sup, dispatcher = _dispatcher("serve", "serve")
        await sup.start_all()
        dispatcher.router.started(0, 100)  # replica 1 is the least loaded: the session opens there
        session = await dispatcher.open_session(4096, "chat-1")
        assert session == "chat-1" and replicas[1].served == [("open_session", (4096, "chat-1"))]
        dispatcher.router.finished(0, 100)
        dispatcher.router.started(1, 1000)  # now replica 0 is the least loaded
        with pytest.raises(InvalidRequest, match="session 'chat-1' is already open"):
            await dispatcher.open_session(4096, "chat-1")  # not a second one on replica 0
        turns = [
            GenerateRequest(input_ids=[i, i + 1], session_params={"id": "chat-1", "rid": f"t{i}"})
            for i in range(3)
        ]
        for turn in turns:
            await dispatcher.generate(turn)
        # A batch of two turns of the session is split, and both parts still go to replica 1.
        await dispatcher.generate(GenerateRequest(
            input_ids=[[7], [8]], session_params=[{"id": "chat-1"}, {"id": "chat-1"}]
        ))  # fmt: skip
        assert replicas[0].served == []
        await dispatcher.close_session("chat-1")
        assert replicas[1].served[-1] == ("close_session", ("chat-1",))
        with pytest.raises(InvalidRequest, match="no open session 'chat-1'"):
            await dispatcher.close_session("chat-1")

    asyncio.run(run())


def test_a_batch_is_split_with_each_prompts_adapter_and_session():
    from rollout.pool.requests import split

    request = GenerateRequest(
        input_ids=[[1, 2], [3, 4]], lora_path=["math", None],
        session_params=[None, {"id": "s"}],
    )  # fmt: skip
    parts, joined = split(request)
    assert joined and [p.request.lora_path for p in parts] == ["math", None]
    assert [p.request.session_params for p in parts] == [None, {"id": "s"}]
    assert [p.rid for p in parts] == [None, "session/s"]
    # Lists of another length than the prompts': not split, one replica gives the engine's error.
    parts, joined = split(GenerateRequest(input_ids=[[1], [2]], lora_path=["math"]))
    assert not joined and len(parts) == 1
