"""Weight sync on CUDA: IPC handoff (no bytes through the scheduler's pipe), NCCL between two
GPUs (a trainer killed mid-broadcast leaves the old weights serving; two ranks on one GPU are
refused clearly), and memory release through torch-memory-saver. Outputs against transformers
on the GPU."""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import multiprocessing as mp
import os
import random
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch.multiprocessing.reductions import reduce_tensor
from trainer_helpers import doomed_trainer
from transformers import AutoModelForCausalLM

from rollout import RolloutEngine
from rollout.weight_sync.sender import WeightSender

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NEW_TOKENS = 10
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(3, 800) for _ in range(n)] for n in (5, 30, 64)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hf(path: str, device: str = "cuda:0") -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


def _hf_greedy(model: torch.nn.Module) -> list[list[int]]:
    device = next(model.parameters()).device
    outs = []
    with torch.no_grad():
        for ids in PROMPTS:
            out = model.generate(
                torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            outs.append(out[0, len(ids) :].tolist())
    return outs


def _greedy(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_cuda_ipc_handoff_matches_transformers(tiny_qwen3, tiny_qwen3_perturbed):
    perturbed = _hf(tiny_qwen3_perturbed)
    expected = _hf_greedy(perturbed)
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cuda") as engine:
        sender = WeightSender(engine, method="tensor", bucket_bytes=64 << 10)
        # fp32 parameters on the GPU go as they are: one IPC handle per parameter storage.
        sender.push(perturbed, weight_version="ipc-1")
        assert _greedy(engine) == expected
        engine.update_weights_from_disk(tiny_qwen3)
        sender.push(perturbed, weight_version="ipc-2")  # the same handles again (cached open)
        assert _greedy(engine) == expected
        # bf16 weights are cast into kept CUDA buckets (one handle per bucket).
        rounded = copy.deepcopy(perturbed).to(torch.bfloat16)  # Module.to works in place
        sender.push(rounded, weight_version="ipc-3")
        assert _greedy(engine) == _hf_greedy(copy.deepcopy(rounded).to(torch.float32))
        sender.free_buckets()
        # Host tensors into a GPU engine travel as shared memory.
        engine.update_weights_from_tensor({n: p.detach().cpu() for n, p in perturbed.named_parameters()})
        assert _greedy(engine) == expected


def _rebuild_cuda_tensor_modified(*args):  # the name SGLang's serializer pickles CUDA tensors by
    raise AssertionError("the engine resolves this name to its own rebuild, never to this")


class _SGLangPickler(ForkingPickler):
    """SGLang's MultiprocessingSerializer after its torch patch: CUDA tensors name their GPU by
    UUID, through `_rebuild_cuda_tensor_modified`."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            _, args = reduce_tensor(obj)
            uuid = str(torch.cuda.get_device_properties(args[6]).uuid)
            return _rebuild_cuda_tensor_modified, (*args[:6], uuid, *args[7:])
        return NotImplemented


def test_sglang_serialized_cuda_tensors_match_transformers(tiny_qwen3, tiny_qwen3_perturbed):
    perturbed = _hf(tiny_qwen3_perturbed)
    expected = _hf_greedy(perturbed)
    named = [(n, p.detach()) for n, p in perturbed.named_parameters()]
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cuda") as engine:
        base = _greedy(engine)
        for pickler in (ForkingPickler, _SGLangPickler):
            buf = io.BytesIO()
            pickler(buf).dump(named)
            payload = base64.b64encode(buf.getvalue()).decode()
            success, message = engine.update_weights_from_tensor([payload], weight_version="sg")
            assert success, message
            assert _greedy(engine) == expected
            engine.update_weights_from_disk(tiny_qwen3)
            assert _greedy(engine) == base


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_between_two_gpus_matches_transformers(tiny_qwen3, tiny_qwen3_perturbed):
    trainer_model = _hf(tiny_qwen3_perturbed, "cuda:1")
    expected = _hf_greedy(trainer_model)
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cuda:0") as engine:
        sender = WeightSender(engine, method="distributed")
        sender.init_group("127.0.0.1", _free_port(), backend="nccl", timeout_s=60, device="cuda:1")
        try:
            sender.push(trainer_model, weight_version="nccl-1")
            assert _greedy(engine) == expected
            engine.update_weights_from_disk(tiny_qwen3)
            sender.push(trainer_model, weight_version="nccl-2", load_format="flattened_bucket")
            assert _greedy(engine) == expected
        finally:
            sender.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_trainer_killed_mid_nccl_broadcast_leaves_the_engine_serving(tiny_qwen3):
    from safetensors.torch import load_file

    from rollout.errors import WeightSyncError

    weights = load_file(f"{tiny_qwen3}/model.safetensors")
    names, shapes = list(weights), [list(t.shape) for t in weights.values()]
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cuda:0") as engine:
        # From scratch each time (no prefix-cache hit).
        engine.flush_cache()
        before = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        version = engine.get_weight_version()
        ctx, port = mp.get_context("spawn"), _free_port()
        ready, sent = ctx.Event(), ctx.Event()
        sends = shapes[: len(shapes) // 2]
        trainer = ctx.Process(target=doomed_trainer, args=(port, 2, sends, ready, sent, 1), daemon=True)
        trainer.start()
        try:
            assert ready.wait(120)
            timeout_s = 5.0
            engine.init_weights_update_group("127.0.0.1", port, 1, 2, "doomed", "nccl", timeout_s=timeout_s)
            call = ThreadPoolExecutor(1).submit(
                engine.update_weights_from_distributed, names, ["float32"] * len(names), shapes, "doomed"
            )  # fmt: skip
            assert sent.wait(120)
            start = time.monotonic()
            os.kill(trainer.pid, signal.SIGKILL)
            with pytest.raises(WeightSyncError, match="rolled back"):
                call.result(timeout=120)
            assert time.monotonic() - start < timeout_s + 20
        finally:
            trainer.kill()
            trainer.join()
        engine.flush_cache()
        after = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
        assert [o["output_ids"] for o in after] == [o["output_ids"] for o in before]
        # Logprobs to the last bits only when the scheduler batches the prompts the same way;
        # a weight left half written moves them far more than this.
        for a, b in zip(after, before, strict=True):
            got = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
            want = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(want, abs=1e-5)
        assert engine.get_weight_version() == version
        engine.destroy_weights_update_group("doomed")
        # A new trainer's group works: the engine's NCCL state survived the abort.
        sender = WeightSender(engine, method="distributed")
        sender.init_group("127.0.0.1", _free_port(), backend="nccl", timeout_s=60, device="cuda:1")
        try:
            sender.push({n: t.to("cuda:1") for n, t in weights.items()}, weight_version="after")
        finally:
            sender.close()
        assert _greedy(engine) == [o["output_ids"] for o in before]


def test_nccl_with_the_trainer_on_the_engines_gpu_is_a_clear_error(tiny_qwen3, tiny_qwen3_perturbed):
    # NCCL takes one GPU per rank: a colocated trainer gets an error naming the problem and
    # the way out (CUDA IPC), not a hang, and the engine keeps serving its weights.
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cuda:0") as engine:
        before = _greedy(engine)
        sender = WeightSender(engine, method="distributed")
        # SGLang's rendezvous has no handshake of ours: NCCL finds the shared GPU when its
        # communicator forms, at the first broadcast.
        sender.init_group("127.0.0.1", _free_port(), backend="nccl", timeout_s=30, device="cuda:0")
        with pytest.raises(ValueError, match="same GPU.*update_weights_from_tensor"):
            sender.push(_hf(tiny_qwen3_perturbed, "cuda:0"), weight_version="never")
        sender.close()
        assert _greedy(engine) == before
        assert engine.get_weight_version() == "default"


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(0)[0]


@pytest.mark.parametrize("cpu_backup", [True, False], ids=["cpu-backup", "push-after-resume"])
def test_release_frees_the_engines_memory_and_resume_serves_the_same_outputs(tiny_qwen3, cpu_backup):
    pytest.importorskip("torch_memory_saver")
    before_engine = _free_bytes()
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cuda", enable_weights_cpu_backup=cpu_backup) as engine:
        reference = _greedy(engine)
        loaded = _free_bytes()
        used = before_engine - loaded
        engine.release_memory_occupation()
        assert _free_bytes() - loaded >= 0.95 * used, (used, _free_bytes() - loaded)
        engine.resume_memory_occupation()
        if cpu_backup:
            assert engine.get_server_info()["weights_missing"] == 0
            assert _greedy(engine) == reference
            return
        # Without a copy the weights must be pushed again; requests wait until then.
        assert engine.get_server_info()["weights_missing"] > 0

        async def run() -> list[dict]:
            waiting = asyncio.ensure_future(engine.async_generate(input_ids=PROMPTS, sampling_params=GREEDY))
            await asyncio.sleep(1.0)
            assert not waiting.done()
            engine.update_weights_from_disk(tiny_qwen3)
            return await waiting

        assert [o["output_ids"] for o in asyncio.run(run())] == reference


def test_a_paused_update_while_the_kv_cache_is_released_backs_up_on_the_device_and_frees_it(tmp_path):
    # The colocated RL loop: the KV cache released for training, generation paused, new weights
    # pushed. With weight_update_backup="auto" what they overwrite waits on the device (there is
    # room), and goes back to the device, not into torch's cache, once they apply: resuming the
    # KV cache (torch-memory-saver allocates outside that cache) must find it.
    pytest.importorskip("torch_memory_saver")
    from transformers import AutoConfig

    from rollout.real_configs import write_config_checkpoint

    path = write_config_checkpoint("qwen3-0.6b", str(tmp_path / "ckpt"))
    options = dict(
        dtype="bfloat16", device="cuda", load_format="dummy", weight_update_backup="auto",
        max_total_tokens=16384,
    )  # fmt: skip
    with RolloutEngine(path, **options) as engine:

        def rank() -> dict:
            return engine.get_server_info()["ranks"][0]

        torch.manual_seed(0)
        with torch.device("cuda"):
            trainer = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
        engine.release_memory_occupation(tags=["kv_cache"])
        reserved, weights = rank()["memory_reserved_bytes"], rank()["weights_bytes"]
        engine.pause_generation()
        WeightSender(engine, method="tensor").push(trainer, weight_version="trained")
        # Staged: written, with what they overwrote kept on the device until continue.
        assert rank()["memory_reserved_bytes"] >= reserved + 0.9 * weights
        engine.continue_generation()
        assert rank()["memory_reserved_bytes"] <= reserved + (64 << 20)
        engine.resume_memory_occupation(tags=["kv_cache"])
        out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert out["meta_info"]["weight_version"] == "trained"
        rows = engine.get_weights_by_name("model.layers.0.mlp.down_proj.weight", truncate_size=2)
        want = trainer.model.layers[0].mlp.down_proj.weight[:2].float().cpu()
        assert torch.equal(torch.tensor(rows, dtype=torch.float32), want)
