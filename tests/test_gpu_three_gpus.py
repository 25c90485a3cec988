"""Runs that need a trainer on a GPU of its own beside a two-GPU engine or two replicas (three
GPUs or more): a tensor-parallel engine (tp 2 on GPUs 0 and 1) updated over NCCL from a trainer
on GPU 2, both ranks or neither when the trainer dies midway; and one NCCL broadcast from GPU 2
reaching two `rollout serve` replicas (GPUs 0 and 1) through `rollout router`."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from pool_helpers import GREEDY, PROMPTS, broadcast_update, free_port, weights
from server_helpers import start_process, start_server, stop_server
from trainer_helpers import doomed_trainer

from rollout import RolloutEngine
from rollout.client import RolloutClient
from rollout.errors import WeightSyncError
from rollout.weight_sync.sender import WeightSender

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs three GPUs"),
]

OPTIONS = {"dtype": "float32", "max_total_tokens": 4096}


def _exact(engine) -> list:
    """Each prompt's tokens and logprobs from scratch (bitwise comparable)."""
    outs = []
    for ids in PROMPTS:
        engine.flush_cache()
        out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        outs.append((out["output_ids"], out["meta_info"]["output_token_logprobs"]))
    return outs


def _greedy(target) -> list[list[int]]:
    return [o["output_ids"] for o in target.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_a_tp2_engine_updated_from_a_trainer_on_a_third_gpu(tiny_qwen3, tiny_qwen3_perturbed):
    with RolloutEngine(tiny_qwen3_perturbed, device="cuda:0", **OPTIONS) as one_rank:
        expected = _greedy(one_rank)
    new = {n: t.to("cuda:2") for n, t in weights(tiny_qwen3_perturbed).items()}
    old = weights(tiny_qwen3)
    names, shapes = list(old), [list(t.shape) for t in old.values()]
    with RolloutEngine(tiny_qwen3, device="cuda", tp_size=2, tp_backend="nccl", **OPTIONS) as engine:
        before = _exact(engine)
        # A trainer that dies midway: neither rank changes, and the engine serves on.
        ctx, port = mp.get_context("spawn"), free_port()
        ready, sent = ctx.Event(), ctx.Event()
        sends = shapes[: len(shapes) // 2]
        trainer = ctx.Process(target=doomed_trainer, args=(port, 3, sends, ready, sent, 2), daemon=True)
        trainer.start()
        try:
            assert ready.wait(120)
            engine.init_weights_update_group("127.0.0.1", port, 1, 3, "doomed", "nccl", timeout_s=5)
            call = ThreadPoolExecutor(1).submit(
                engine.update_weights_from_distributed, names, ["float32"] * len(names), shapes,
                "doomed",
            )  # fmt: skip
            assert sent.wait(120)
            os.kill(trainer.pid, signal.SIGKILL)
            with pytest.raises(WeightSyncError, match="rolled back"):
                call.result(timeout=120)
        finally:
            trainer.kill()
            trainer.join()
        assert _exact(engine) == before and engine.get_weight_version() == "default"
        engine.destroy_weights_update_group("doomed")

        # A trainer on GPU 2 reaches both ranks (their slices of every tensor).
        sender = WeightSender(engine, method="distributed")
        sender.init_group("127.0.0.1", free_port(), backend="nccl", timeout_s=60, device="cuda:2")
        try:
            sender.push(new, weight_version="nccl-tp2")
            assert _greedy(engine) == expected
            sender.push(new, weight_version="nccl-tp2-flat", load_format="flattened_bucket")
            assert _greedy(engine) == expected
        finally:
            sender.close()
        assert engine.get_weight_version() == "nccl-tp2-flat"


def test_one_broadcast_from_a_third_gpu_reaches_two_replicas(tiny_qwen3, tiny_qwen3_perturbed):
    with RolloutEngine(tiny_qwen3_perturbed, device="cuda:0", **OPTIONS) as one:
        expected = _greedy(one)
    procs = []
    try:
        urls = []
        for gpu in range(2):
            proc, url = start_server(tiny_qwen3, "--device", "cuda", "--base-gpu-id", str(gpu))
            procs.append(proc)
            urls.append(url)
        router = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "rollout.cli", "router", "--worker-urls", *urls,
               "--model-path", tiny_qwen3, "--port", router.rsplit(":", 1)[1]]  # fmt: skip
        procs.append(start_process(cmd, router))
        with RolloutClient(router) as client:
            info = client.get_server_info()
            assert sorted(r["info"]["device"] for r in info["replicas"]) == ["cuda:0", "cuda:1"]
            result = broadcast_update(
                client, weights(tiny_qwen3_perturbed), world_size=3, version="three",
                backend="nccl", device="cuda:2",
            )  # fmt: skip
            assert result["weight_version"] == "three"
        for url in urls:
            with RolloutClient(url) as worker:
                assert worker.get_weight_version() == "three"
                assert _greedy(worker) == expected
    finally:
        for proc in procs:
            stop_server(proc)
