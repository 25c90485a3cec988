"""An unmodified SGLang-style trainer updates the engine over gloo (and NCCL between two GPUs): SGLang's rendezvous of
`init_weights_update_group` and the wire format of `update_weights_from_distributed` (per tensor,
and flattened_bucket), over HTTP (`rollout serve`) and through the Engine API. Outputs then equal
transformers on the new weights; a bad name or shape changes nothing and the group stays usable.

The trainer below is written from SGLang's documented protocol with plain torch.distributed, as
slime and AReaL do it: rendezvous at tcp://{master_address}:{master_port} as rank 0 of
1 + engine ranks, the group's store under PrefixStore(group_name), torch's own process-group
helper, then one `dist.broadcast` per tensor, or one of every tensor's bytes concatenated
(uint8) per flattened bucket. It sends nothing else: no handshake of ours.
"""

from __future__ import annotations

import datetime
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import torch.distributed as dist
from hf_reference import hf_greedy
from server_helpers import free_port, start_server, stop_server
from sglang_shapes import checkpoint_tensors
from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

NEW_TOKENS = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
_rng = random.Random(27)
PROMPTS = [[_rng.randrange(3, 800) for _ in range(n)] for n in (6, 19)]
TIMEOUT_S = 60


# ---- the SGLang-style trainer ---------------------------------------------------------------
def trainer_group(port: int, world_size: int, group_name: str, backend: str = "gloo") -> dist.ProcessGroup:
    """Rank 0 of the weight update group, made the way SGLang's init_custom_process_group makes
    it on both of its ends."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    url = f"tcp://127.0.0.1:{port}"
    store, rank, world = next(dist.rendezvous(url, 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world, rank, [], Backend(backend), dist.PrefixStore(group_name, store),
        group_name=group_name, timeout=timeout,
    )  # fmt: skip
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def trainer_broadcast(pg, named: list[tuple[str, torch.Tensor]], load_format: str | None) -> None:
    if load_format == "flattened_bucket":
        flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in named])
        dist.broadcast(flat, src=0, group=pg)
        return
    works = [dist.broadcast(t.contiguous(), src=0, group=pg, async_op=True) for _, t in named]
    for work in works:
        work.wait()


def update_args(named: list[tuple[str, torch.Tensor]], group_name: str, **extra) -> dict:
    return {
        "names": [n for n, _ in named],
        "dtypes": [str(t.dtype) for _, t in named],  # "torch.float32", as slime sends them
        "shapes": [list(t.shape) for _, t in named],
        "group_name": group_name,
        **extra,
    }


@pytest.fixture(scope="module")
def expected(tiny_qwen3, tiny_qwen3_perturbed) -> dict[str, list[list[int]]]:
    return {
        "base": hf_greedy(tiny_qwen3, PROMPTS, NEW_TOKENS),
        "perturbed": hf_greedy(tiny_qwen3_perturbed, PROMPTS, NEW_TOKENS),
    }


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(2) as p:
        yield p


# ---- over HTTP --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(tiny_qwen3):
    proc, base = start_server(tiny_qwen3)
    yield base
    stop_server(proc)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/{path}", json=body, timeout=TIMEOUT_S + 30)


def _http_greedy(url: str) -> list[list[int]]:
    body = {"input_ids": PROMPTS, "sampling_params": GREEDY}
    return [o["output_ids"] for o in _post(url, "generate", body).json()]


def _http_update(url, pool, pg, named, group, load_format=None, **extra) -> httpx.Response:
    body = update_args(named, group, load_format=load_format, **extra)
    reply = pool.submit(_post, url, "update_weights_from_distributed", body)
    trainer_broadcast(pg, named, load_format)
    return reply.result(timeout=TIMEOUT_S)


def test_an_sglang_trainer_updates_rollout_serve(url, pool, expected, tiny_qwen3, tiny_qwen3_perturbed):
    group, port = "weight_update_group", free_port()
    init = {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": group, "backend": "gloo",
    }  # fmt: skip
    joined = pool.submit(_post, url, "init_weights_update_group", init)
    pg = trainer_group(port, 2, group)
    try:
        reply = joined.result(timeout=TIMEOUT_S)
        assert reply.status_code == 200 and reply.json()["success"], reply.text
        assert _http_greedy(url) == expected["base"]

        per_tensor = _http_update(
            url, pool, pg, checkpoint_tensors(tiny_qwen3_perturbed), group, flush_cache=False,
            abort_all_requests=False, weight_version="sglang-1",
        )  # fmt: skip
        assert per_tensor.status_code == 200 and per_tensor.json()["success"], per_tensor.text
        assert _http_greedy(url) == expected["perturbed"]
        assert httpx.get(f"{url}/get_weight_version").json()["weight_version"] == "sglang-1"

        bucket = _http_update(url, pool, pg, checkpoint_tensors(tiny_qwen3), group, "flattened_bucket")
        assert bucket.status_code == 200 and bucket.json()["success"], bucket.text
        assert _http_greedy(url) == expected["base"]

        version = httpx.get(f"{url}/get_weight_version").json()["weight_version"]
        good = checkpoint_tensors(tiny_qwen3_perturbed)
        bad_name = [("model.layers.0.no_such.weight", good[0][1]), *good[1:]]
        name = good[0][0]
        bad_shape = [(name, torch.zeros(3, 5)), *good[1:]]
        for bad, load_format in ((bad_name, None), (bad_shape, "flattened_bucket")):
            refused = _http_update(url, pool, pg, bad, group, load_format, weight_version="never")
            assert refused.status_code == 400, refused.text
            assert "does not fit the model" in refused.text
            assert _http_greedy(url) == expected["base"]  # rolled back: nothing changed
            assert httpx.get(f"{url}/get_weight_version").json()["weight_version"] == version

        again = _http_update(url, pool, pg, good, group, "flattened_bucket", weight_version="s-2")
        assert again.status_code == 200, again.text  # the group survived the refusals
        assert _http_greedy(url) == expected["perturbed"]
    finally:
        left = _post(url, "destroy_weights_update_group", {"group_name": group})
        dist.destroy_process_group(pg)
    assert left.status_code == 200 and left.json()["success"]


# ---- through the Engine API -------------------------------------------------------------------
def _greedy(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_an_sglang_trainer_updates_the_engine_api(engine, pool, expected, tiny_qwen3, tiny_qwen3_perturbed):
    group, port = "engine_group", free_port()
    joined = pool.submit(engine.init_weights_update_group, "127.0.0.1", port, 1, 2, group, "gloo")
    pg = trainer_group(port, 2, group)
    try:
        success, message = joined.result(timeout=TIMEOUT_S)  # SGLang's (success, message)
        assert success and group in message

        for path, load_format, key in (
            (tiny_qwen3_perturbed, "flattened_bucket", "perturbed"), (tiny_qwen3, None, "base"),
        ):  # fmt: skip
            named = checkpoint_tensors(path)
            args = update_args(named, group, load_format=load_format)
            done = pool.submit(engine.update_weights_from_distributed, **args)
            trainer_broadcast(pg, named, load_format)
            success, message = done.result(timeout=TIMEOUT_S)
            assert success, message
            assert _greedy(engine) == expected[key]

        version = engine.get_weight_version()
        named = checkpoint_tensors(tiny_qwen3_perturbed)
        bad = [(named[0][0], torch.zeros(2, 2)), *named[1:]]
        done = pool.submit(engine.update_weights_from_distributed, **update_args(bad, group))
        trainer_broadcast(pg, bad, None)
        with pytest.raises(ValueError, match="shape mismatch"):
            done.result(timeout=TIMEOUT_S)
        assert _greedy(engine) == expected["base"] and engine.get_weight_version() == version
    finally:
        success, _ = engine.destroy_weights_update_group(group)
        dist.destroy_process_group(pg)
    assert success


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_an_sglang_trainer_on_another_gpu_updates_the_engine_over_nccl(
    pool, expected, tiny_qwen3, tiny_qwen3_perturbed
):
    from rollout import RolloutEngine

    group, port = "nccl_group", free_port()
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cuda:0") as engine, torch.cuda.device(1):
        joined = pool.submit(engine.init_weights_update_group, "127.0.0.1", port, 1, 2, group, "nccl")
        pg = trainer_group(port, 2, group, "nccl")
        try:
            success, message = joined.result(timeout=TIMEOUT_S)
            assert success, message
            for path, load_format, key in (
                (tiny_qwen3_perturbed, None, "perturbed"), (tiny_qwen3, "flattened_bucket", "base"),
            ):  # fmt: skip
                named = [(n, t.to("cuda:1")) for n, t in checkpoint_tensors(path)]
                args = update_args(named, group, load_format=load_format, weight_version=key)
                done = pool.submit(engine.update_weights_from_distributed, **args)
                trainer_broadcast(pg, named, load_format)
                success, message = done.result(timeout=TIMEOUT_S)
                assert success, message
                assert _greedy(engine) == expected[key]
                assert engine.get_weight_version() == key
        finally:
            # As a trainer leaves: the engine's call and its own destroy at once (NCCL's
            # shutdown finalizes with the other ranks).
            left = pool.submit(engine.destroy_weights_update_group, group)
            dist.destroy_process_group(pg)
            success, _ = left.result(timeout=TIMEOUT_S)
        assert success
