"""KVManager's batched decode allocation: one slot per request, at each request's next position."""

from __future__ import annotations

import torch

from rollout.engine.kv_manager import KVManager
from rollout.engine.messages import TokenizedRequest
from rollout.engine.req import Req
from rollout.engine.sampling_params import SamplingParams
from rollout.forward.kv_pool import ReqToTokenPool


def _req(rid: str, ids: list[int]) -> Req:
    return Req(req=TokenizedRequest(rid=rid, input_ids=ids, params=SamplingParams(), seed=0), max_new_tokens=8)


def test_allocate_decode_writes_each_rows_next_position_and_release_makes_the_pool_whole():
    kv = KVManager(64, ReqToTokenPool(4, 32, "cpu"), disable_cache=False)
    reqs = [_req("a", [1, 2, 3]), _req("b", [4, 5, 6, 7, 8])]
    for r in reqs:
        assert kv.attach(r)
        assert kv.allocate(r, len(r.ids)) is not None
        r.kv_len = len(r.ids)
    before = [kv.req_to_token.read(r.row, 0, r.kv_len).clone() for r in reqs]
    slots = kv.allocate_decode(reqs)
    assert slots is not None and slots.numel() == 2 and len(set(slots.tolist())) == 2
    for r, old, slot in zip(reqs, before, slots.tolist()):
        assert torch.equal(kv.req_to_token.read(r.row, 0, r.kv_len), old)  # earlier positions kept
        assert kv.req_to_token.read(r.row, r.kv_len, r.kv_len + 1).item() == slot
        r.kv_len += 1
        r.output_ids.append(9)
    assert kv.allocator.available() == 64 - 3 - 5 - 2
    for r in reqs:
        kv.release(r)
    assert kv.is_whole()


def test_allocate_decode_evicts_cached_prefixes_and_refuses_when_the_pool_is_held():
    kv = KVManager(16, ReqToTokenPool(4, 32, "cpu"), disable_cache=False)
    done = _req("done", list(range(10, 22)))
    assert kv.attach(done) and kv.allocate(done, 12) is not None
    done.kv_len = 12
    kv.release(done)  # its 12 slots now sit in the cache, unlocked
    live = [_req(f"r{i}", [i + 1]) for i in range(3)]
    for r in live:
        assert kv.attach(r) and kv.allocate(r, 1) is not None
        r.kv_len = 1
    assert kv.allocator.available() == 1
    assert kv.allocate_decode(live) is not None  # evicted cache entries to find 3 slots
    hog = KVManager(4, ReqToTokenPool(4, 8, "cpu"), disable_cache=True)
    held = [_req(f"h{i}", [i + 1, i + 2]) for i in range(2)]
    for r in held:
        assert hog.attach(r) and hog.allocate(r, 2) is not None
        r.kv_len = 2
    assert hog.allocate_decode(held) is None
