"""Weight-sync speed on a GPU: prints one JSON line per path.

    python benchmarks/bench_weight_sync.py --model qwen2.5-7b --paths tensor disk memory
    python benchmarks/bench_weight_sync.py --model qwen2.5-7b --paths nccl     # two GPUs

A NAME of a real model (see REAL_CONFIGS) runs its config with random bf16 weights. The
trainer's copy of the weights lives in this process. Paths:
- tensor: the trainer's bf16 tensors on the engine's GPU, pushed with WeightSender
  (CUDA IPC handles, no copy); each step timed, the first includes opening the handles.
- nccl: the trainer on cuda:1 broadcasts to the engine on cuda:0 (per tensor, then flattened).
- disk: a checkpoint written once, then reloaded (the second read comes from the page cache).
- memory: release_memory_occupation() of everything (how much GPU memory it gave back), then
  resume with the engine's CPU copy of the weights; outputs checked unchanged.
Targets (issue 4, one H100, 7B): tensor <= 0.1 s from the second step, nccl <= 1 s, disk
<= 10 s, release <= 0.5 s, resume with CPU copy <= 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from rollout import RolloutEngine  # noqa: E402
from rollout.config import BACKUPS  # noqa: E402
from rollout.models.loader import build_model  # noqa: E402
from rollout.real_configs import REAL_CONFIGS, write_config_checkpoint  # noqa: E402
from rollout.weight_sync.sender import WeightSender  # noqa: E402

PATHS = ("tensor", "nccl", "disk", "memory")
PROBE = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def trainer_weights(model_path: str, device: str) -> dict[str, torch.Tensor]:
    """Random bf16 tensors under every HF name the engine's model loads."""
    model = build_model(AutoConfig.from_pretrained(model_path), torch.bfloat16, "meta")
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        name: torch.randn(shape, dtype=torch.bfloat16, device=device, generator=gen) * 0.02
        for name, (shape, _) in model.hf_param_shapes().items()
    }


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    return round(time.perf_counter() - start, 4)


def gib(n: float) -> float:
    return round(n / 2**30, 2)


def bench_tensor(engine: RolloutEngine, weights: dict, steps: int) -> dict:
    sender = WeightSender(engine, method="tensor")
    times = [timed(lambda i=i: sender.push(weights, weight_version=f"tensor-{i}")) for i in range(steps)]
    name = next(iter(weights))
    ok = torch.equal(torch.tensor(engine.get_weights_by_name(name, 2)), weights[name][:2].float().cpu())
    return {"seconds_per_step": times, "loaded_ok": ok}


def bench_nccl(engine: RolloutEngine, weights: dict, steps: int) -> dict:
    on_1 = {n: t.to("cuda:1") for n, t in weights.items()}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender = WeightSender(engine, method="distributed")
    setup = timed(lambda: sender.init_group("127.0.0.1", port, backend="nccl", timeout_s=120, device="cuda:1"))
    try:
        per_tensor = [timed(lambda: sender.push(on_1)) for _ in range(steps)]
        flat = [timed(lambda: sender.push(on_1, load_format="flattened_bucket")) for _ in range(steps)]
    finally:
        sender.close()
    return {"join_seconds": setup, "seconds_per_step": per_tensor, "flattened_seconds_per_step": flat}


def bench_disk(engine: RolloutEngine, weights: dict, model_path: str) -> dict:
    from safetensors.torch import save_file

    ckpt = tempfile.mkdtemp(prefix="rollout-bench-ckpt-")
    write_start = time.perf_counter()
    save_file({n: t.cpu() for n, t in weights.items()}, os.path.join(ckpt, "model.safetensors"))
    with open(os.path.join(model_path, "config.json")) as src, open(os.path.join(ckpt, "config.json"), "w") as dst:
        dst.write(src.read())
    written = round(time.perf_counter() - write_start, 2)
    first = timed(lambda: engine.update_weights_from_disk(ckpt, weight_version="disk-1"))
    cached = timed(lambda: engine.update_weights_from_disk(ckpt, weight_version="disk-2"))
    return {"write_seconds": written, "first_seconds": first, "page_cache_seconds": cached}


def bench_memory(engine: RolloutEngine) -> dict:
    before = engine.generate(input_ids=[1, 2, 3, 4], sampling_params=PROBE)["output_ids"]
    free_loaded = torch.cuda.mem_get_info(0)[0]
    release = timed(engine.release_memory_occupation)
    free_released = torch.cuda.mem_get_info(0)[0]
    resume = timed(engine.resume_memory_occupation)
    after = engine.generate(input_ids=[1, 2, 3, 4], sampling_params=PROBE)["output_ids"]
    return {
        "release_seconds": release,
        "resume_seconds": resume,
        "freed_gib": gib(free_released - free_loaded),
        "outputs_unchanged": before == after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", help=f"one of {sorted(REAL_CONFIGS)}")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=["tensor", "disk", "memory"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-total-tokens", type=int, default=65536)
    parser.add_argument("--weight-update-backup", default="cpu", choices=BACKUPS,
                        help="where a streamed (per-tensor nccl) update keeps what it overwrites")
    args = parser.parse_args()
    if args.model.lower() not in REAL_CONFIGS:
        parser.error(f"--model must be one of {sorted(REAL_CONFIGS)}")
    model_path = write_config_checkpoint(args.model.lower(), tempfile.mkdtemp(prefix="rollout-bench-"))
    weights = trainer_weights(model_path, "cuda:0")
    options = {
        "dtype": "bfloat16", "device": "cuda:0", "load_format": "dummy",
        "max_total_tokens": args.max_total_tokens, "enable_weights_cpu_backup": "memory" in args.paths,
        "weight_update_backup": args.weight_update_backup,
    }  # fmt: skip
    with RolloutEngine(model_path, **options) as engine:
        common = {"model": args.model, "weights_gib": gib(sum(t.numel() * 2 for t in weights.values())),
                  "weight_update_backup": args.weight_update_backup}  # fmt: skip
        for path in args.paths:
            if path == "nccl" and torch.cuda.device_count() < 2:
                print(json.dumps({**common, "path": path, "skipped": "needs two GPUs"}))
                continue
            if path == "tensor":
                result = bench_tensor(engine, weights, args.steps)
            elif path == "nccl":
                result = bench_nccl(engine, weights, args.steps)
            elif path == "disk":
                result = bench_disk(engine, weights, model_path)
            else:
                result = bench_memory(engine)
            print(json.dumps({**common, "path": path, **result}), flush=True)


if __name__ == "__main__":
    main()
