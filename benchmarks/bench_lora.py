"""LoRA serving and adapter-sync speed on a GPU: prints one JSON line per measurement.

    python benchmarks/bench_lora.py --model qwen2.5-7b
    python benchmarks/bench_lora.py --model /tmp/rollout-tiny --num-seqs 8 --len 16 --device cpu

A NAME of a real model (see REAL_CONFIGS) runs its config with random weights; the adapters are
random PEFT adapters on every linear projection, written here. Measurements, in one process:
- batch: --num-seqs greedy requests of --len prompt and --len output tokens, first on an engine
  without LoRA, then on one with --adapters adapters (ranks spread over --ranks) whose requests
  take the adapters in turn; output tok/s of both and their ratio.
- batch1: one request's decode step (t(n tokens) - t(1 token)) / (n - 1) on the base engine and
  on the LoRA engine with one adapter; ratio of tok/s.
- prefill: the batch's prompts with one output token, the prefix cache flushed first (best of
  two), base and LoRA.
- sync: a rank --sync-rank adapter of the same modules pushed with WeightSender (tensor handles
  on the engine's GPU; CPU tensors on a CPU), seconds per push, first push included.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from benchmarks.run_counters import compiled_between, step_times  # noqa: E402
from rollout import RolloutEngine  # noqa: E402
from rollout.models.lora_adapter import CONFIG_FILE, LORA_MODULES, WEIGHTS_FILE  # noqa: E402
from rollout.real_configs import REAL_CONFIGS, write_config_checkpoint  # noqa: E402
from rollout.weight_sync.sender import WeightSender  # noqa: E402

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each LoRA target projection of one layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }


def adapter_tensors(config, rank: int, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """PEFT-named random lora_A / lora_B tensors of every projection of every layer."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for layer in range(config.num_hidden_layers):
        for proj, (fan_in, fan_out) in module_shapes(config).items():
            part = "self_attn" if proj in ATTN else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            a = torch.randn(rank, fan_in, generator=gen, device=device) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen, device=device) * 0.01
            out[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
            out[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
    return out


def write_adapter(config, rank: int, seed: int, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    save_file(adapter_tensors(config, rank, seed), os.path.join(directory, WEIGHTS_FILE))
    spec = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_MODULES)}
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(spec, f)
    return directory


def fixed_prompts(num: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, min(vocab, 10000), (num, length), generator=gen).tolist()


def timed_generate(engine: RolloutEngine, prompts, max_new: int, lora=None) -> float:
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params, lora_path=lora)
    return time.perf_counter() - start


def step_seconds(engine: RolloutEngine, prompt, n: int, lora=None) -> float:
    """Decode step time of one request: (t(n) - t(1)) / (n - 1), best of three each."""
    one = min(timed_generate(engine, [prompt], 1, lora) for _ in range(3))
    full = min(timed_generate(engine, [prompt], n, lora) for _ in range(3))
    return (full - one) / (n - 1)


def prefill_seconds(engine: RolloutEngine, prompts, lora=None) -> float:
    """The prompts' prefill with one output token, the prefix cache flushed first; best of two."""
    times = []
    for _ in range(2):
        engine.flush_cache()
        times.append(timed_generate(engine, prompts, 1, lora))
    return min(times)


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def run(args: argparse.Namespace, model_path: str, config) -> None:
    prompts = fixed_prompts(args.num_seqs, args.len, config.vocab_size)
    total = args.num_seqs * args.len
    common = dict(
        dtype=args.dtype, device=args.device, max_total_tokens=args.max_total_tokens,
        disable_pdl=args.disable_pdl,
    )
    if args.model in REAL_CONFIGS:
        common["load_format"] = "dummy"  # random weights: speed does not depend on them

    base = RolloutEngine(model_path, **common)
    try:
        timed_generate(base, prompts[:4], 8)
        base_before = base.get_server_info()
        base_s = timed_generate(base, prompts, args.len)
        base_steps = step_times(
            base_before["device_busy_by_step"], base.get_server_info()["device_busy_by_step"]
        )
        base_prefill = prefill_seconds(base, prompts)
        base_step = step_seconds(base, prompts[0], args.len)
    finally:
        base.shutdown()

    root = tempfile.mkdtemp(prefix="rollout-bench-lora-")
    ranks = [args.ranks[i % len(args.ranks)] for i in range(args.adapters)]
    paths = [f"a{i}={write_adapter(config, r, i, os.path.join(root, f'a{i}'))}" for i, r in enumerate(ranks)]
    overlap = {} if args.lora_overlap_max_rows is None else {"lora_overlap_max_rows": args.lora_overlap_max_rows}
    engine = RolloutEngine(
        model_path, enable_lora=True, max_loras_per_batch=args.adapters + 1,
        max_lora_rank=max(max(ranks), args.sync_rank), lora_paths=paths, **common, **overlap,
    )
    try:
        names = [f"a{i % args.adapters}" for i in range(args.num_seqs)]
        timed_generate(engine, prompts[:4], 8, names[:4])
        before = engine.get_server_info()
        lora_s = timed_generate(engine, prompts, args.len, names)
        info = engine.get_server_info()
        again_s = timed_generate(engine, prompts, args.len, names)  # prefix cache hits: decode
        lora_steps = step_times(before["device_busy_by_step"], info["device_busy_by_step"])
        emit(bench="lora_batch", num_seqs=args.num_seqs, len=args.len, ranks=ranks,
             base_tok_per_s=round(total / base_s, 1), lora_tok_per_s=round(total / lora_s, 1),
             ratio=round(base_s / lora_s, 3), again_tok_per_s=round(total / again_s, 1),
             compiled_in_run=compiled_between(before, info), kernel_plan=info.get("kernel_plan"))
        # Device time a step by kind in the two timed runs: LoRA's extra time per step next to
        # its wall time tells the kernels' share from the host's.
        emit(bench="lora_batch_steps", base=base_steps, lora=lora_steps)
        lora_prefill = prefill_seconds(engine, prompts, names)
        emit(bench="lora_prefill", tokens=total, base_s=round(base_prefill, 4),
             lora_s=round(lora_prefill, 4), ratio=round(base_prefill / lora_prefill, 3))
        lora_step = step_seconds(engine, prompts[0], args.len, "a0")
        emit(bench="lora_batch1", base_step_ms=round(base_step * 1e3, 3),
             lora_step_ms=round(lora_step * 1e3, 3), ratio=round(base_step / lora_step, 3), rank=ranks[0])
        sync_dir = write_adapter(config, args.sync_rank, 99, os.path.join(root, "sync"))
        engine.load_lora_adapter("policy", sync_dir)
        weights = adapter_tensors(config, args.sync_rank, 7, args.device)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        sender = WeightSender(engine, method="tensor", lora_name="policy")
        times = []
        for step in range(args.sync_steps):
            if args.device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            sender.push(weights, weight_version=f"sync-{step}")
            times.append(round(time.perf_counter() - start, 4))
        emit(bench="lora_sync", rank=args.sync_rank, adapter_mib=round(nbytes / 2**20, 1), seconds_per_push=times)
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", help=f"a checkpoint directory or one of {sorted(REAL_CONFIGS)}")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--len", type=int, default=256, help="prompt and output tokens of each request")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--sync-rank", type=int, default=64)
    parser.add_argument("--sync-steps", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-total-tokens", type=int, default=65536)
    parser.add_argument("--disable-pdl", action="store_true", help="no programmatic dependent launch")
    parser.add_argument(
        "--lora-overlap-max-rows", type=int, default=None,
        help="the LoRA engine's lora_overlap_max_rows (default: the engine's; 0: LoRA after the GEMMs)",
    )  # fmt: skip
    args = parser.parse_args()
    model_path = args.model
    if model_path in REAL_CONFIGS:
        model_path = write_config_checkpoint(model_path, tempfile.mkdtemp(prefix=f"rollout-{args.model}-"))
    run(args, model_path, AutoConfig.from_pretrained(model_path))


if __name__ == "__main__":
    main()
