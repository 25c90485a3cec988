"""Offline throughput: prints one JSON line with output_tok_per_s.

    python benchmarks/bench_offline.py --model qwen3-0.6b --workload nano
    python benchmarks/bench_offline.py --model /path/to/ckpt --workload grpo --num-seqs 8 \\
        --max-len 64
    python benchmarks/bench_offline.py --model qwen2.5-7b --workload fixed --num-seqs 64 \\
        --max-len 256 --compare hf
    python benchmarks/bench_offline.py --model llama-3.1-8b --workload random --num-seqs 500 \\
        --input-len 4096 --output-len 2048
    python benchmarks/bench_offline.py --model qwen2.5-7b --workload rl
    python benchmarks/bench_offline.py --model qwen2.5-7b --workload agent

On a CPU, with the project's tiny model (seconds):

    rollout tiny-model /tmp/rollout-tiny
    python benchmarks/bench_offline.py --model /tmp/rollout-tiny --workload nano --num-seqs 4 \\
        --max-len 100

`nano` is the nano-vllm workload (256 sequences, input and output lengths uniform in
100..1024, `random.seed(0)`, prompts drawn before output lengths, token ids randint(0, 10000),
temperature 0.6, ignore_eos). `grpo` is 64 prompts of 64..512 tokens x n=8 samples of --max-len
tokens. `fixed` is num_seqs greedy requests of exactly max_len prompt and max_len output tokens
(or --input-len / --output-len). `random` is SGLang's random dataset as its CI benchmarks it
(`bench_serving --dataset-name random`, range ratio 0): prompt lengths uniform in
[1, input_len] and output lengths uniform in [1, output_len] (`--range-ratio r` raises both
lower bounds to r x the length), ignore_eos, greedy. `rl` is a GRPO rollout phase: 128 prompts
of 512..1024 tokens x 8 samples each (sent as n=8 sends them: one request per sample, a group's
requests next to each other, sharing their prompt), temperature 1.0, return_logprob, and output
lengths as reasoning rollouts have them: lognormal with median --max-len / 5 (4096 / 5) and
sigma 1, capped at --max-len (4096), drawn per sample after the prompts from the same seeded
stream (many short samples, a long tail, a few cut off at the cap), ignore_eos. `agent` is one
turn of 256 agent trajectories whose conversations have grown unevenly: prompt lengths
lognormal with median --max-len / 16 (16384 / 16) and sigma 1.5, capped at --max-len (many
short contexts, a few long ones in the same decode batches), replies uniform in 128..512
tokens, temperature 1.0, return_logprob, ignore_eos.

Token ids are drawn in 0..10000 and taken modulo the model's vocabulary (config.json's
vocab_size), so a model with a larger one sees exactly nano-vllm's prompts and a smaller one
still gets valid ids. A prompt and its output must fit the model's context together; lengths
that cannot are refused before the engine starts.

A NAME of a real model (see REAL_CONFIGS) runs its real config with random weights (speed does
not depend on them). `--compare hf` then runs transformers `generate` on the same model and
prompts in this process (after the engine has shut down, on a GPU), in left-padded batches of
--hf-batch-size, and prints the ratio.

Besides throughput, each run reports when the samples finished (e2e_latency from submission:
the median, the 90th percentile and the last) and how much of the wall time the device was
idle: 1 - the device's time in steps (get_server_info's device_busy_s: timing events around
every launch on a GPU, the time inside launches on the CPU) over the wall time. That is the idle
time between steps; a gap inside a launch (the device waiting for the host to queue the rest of
its step) counts as busy: profile_workload.py shows those per step. `--poll-ms N` calls
get_server_info every N ms during the timed run, as a monitor scraping /metrics or /get_load
does (both read it): run with and without it to see what monitoring costs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.run_counters import (  # noqa: E402
    collector_seconds_between,
    compiled_between,
    step_times,
)
from benchmarks.workloads import (  # noqa: E402
    DEFAULT_MAX_LEN,
    DEFAULT_NUM_SEQS,
    MAX_LEN_ONLY,
    NANO_MIN_LEN,
    PROMPT_LENS,
    WORKLOADS,
    draw,
    longest_lengths,
)
from rollout import RolloutEngine  # noqa: E402
from rollout.config import CacheOptions, KernelOptions  # noqa: E402
from rollout.real_configs import REAL_CONFIGS, write_config_checkpoint  # noqa: E402


def resolve_lengths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills in the workload's defaults and refuses lengths it cannot draw from (with
    parser.error: exit status 2 and a message naming the flag). Afterwards args.input_len and
    args.output_len are the longest prompt and output the workload can make."""
    w = args.workload
    for flag in ("num_seqs", "max_len", "input_len", "output_len", "hf_batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if not 0 <= args.range_ratio <= 1:
        parser.error(f"--range-ratio must be in [0, 1], got {args.range_ratio}")
    if w != "random" and args.range_ratio:
        parser.error(f"--range-ratio applies to --workload random only, not {w}")
    if w in MAX_LEN_ONLY and (args.input_len or args.output_len):
        parser.error(f"--input-len and --output-len apply to --workload fixed and random; {w} "
                     "takes --max-len")  # fmt: skip
    args.num_seqs = args.num_seqs or DEFAULT_NUM_SEQS[w]
    args.max_len = args.max_len or DEFAULT_MAX_LEN[w]
    if w == "nano" and args.max_len < NANO_MIN_LEN:
        parser.error(
            f"--max-len must be >= {NANO_MIN_LEN} for --workload nano (its prompt and output "
            f"lengths are uniform in {NANO_MIN_LEN}..max-len), got {args.max_len}"
        )
    if w in MAX_LEN_ONLY:
        args.input_len, args.output_len = longest_lengths(w, args.max_len)
    else:
        args.input_len = args.input_len or args.max_len
        args.output_len = args.output_len or args.max_len


def check_context(
    parser: argparse.ArgumentParser, args: argparse.Namespace, context: int, source: str
) -> None:
    """A prompt and its output must fit the context together (else the engine cuts the output
    short or refuses the prompt)."""
    total = args.input_len + args.output_len
    if total <= context:
        return
    flags = f"--input-len {args.input_len} / --output-len {args.output_len}"
    if args.workload == "nano":
        flags = f"--max-len {args.max_len}"
    elif args.workload in PROMPT_LENS:
        flags = f"--max-len {args.max_len} (prompts are up to {args.input_len} tokens)"
    elif args.workload == "agent":
        flags = f"--max-len {args.max_len} (replies are up to {args.output_len} tokens)"
    parser.error(
        f"--workload {args.workload} with {flags} makes prompts of up to {args.input_len} and "
        f"outputs of up to {args.output_len} tokens, {total} in all, over the model's context "
        f"of {context} tokens ({source}); lower the lengths"
    )


def read_config(parser: argparse.ArgumentParser, model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        parser.error(f"--model {model_dir}: cannot read a checkpoint's config.json ({e})")
    # Multimodal checkpoints keep the language model's sizes under text_config.
    text = {**config.get("text_config", {}), **config}
    if not isinstance(text.get("vocab_size"), int):
        parser.error(f"--model {model_dir}: config.json has no vocab_size")
    return text


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    kernels, cache = KernelOptions(), CacheOptions()  # the engine's defaults
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", "--model-path", dest="model", required=True,
        help=f"checkpoint dir or one of {sorted(REAL_CONFIGS)}")  # fmt: skip
    add("--workload", choices=WORKLOADS, default="nano")
    add("--num-seqs", type=int,
        help="sequences (nano 256, fixed 64, random 500, agent 256) or prompts (grpo 64, rl 128)")  # fmt: skip
    add("--max-len", type=int,
        help="nano: max prompt and output length (1024, at least 100); grpo: output length "
        "(512); rl: max output length (4096); agent: max prompt length (16384); fixed and "
        "random: default of --input-len and --output-len (256, 1024)")  # fmt: skip
    add("--input-len", type=int, help="fixed: prompt length; random: max prompt length")
    add("--output-len", type=int, help="fixed: output length; random: max output length")
    add("--range-ratio", type=float, default=0.0,
        help="random: lower bound of the lengths, as a fraction of them, in [0, 1]")  # fmt: skip
    add("--poll-ms", type=float,
        help="call get_server_info every this many ms during the timed run (a monitor)")  # fmt: skip
    add("--return-logprob", action=argparse.BooleanOptionalAction,
        help="ask for each output token's logprob (default: on for rl and agent, off "
        "otherwise)")  # fmt: skip
    add("--dtype", default="auto")
    add("--device", default=None)
    add("--disable-radix-cache", action="store_true")
    add("--max-total-tokens", type=int)
    add("--attention-backend", default=kernels.attention_backend)
    add("--disable-cuda-graph", action="store_true")
    add("--cuda-graph-max-bs", type=int, default=kernels.cuda_graph_max_bs,
        help="decode batches of up to this many rows replay CUDA graphs")  # fmt: skip
    add("--cuda-graph-max-extend-tokens", type=int, default=kernels.cuda_graph_max_extend_tokens,
        help="extends of up to this many tokens replay CUDA graphs (0: none)")  # fmt: skip
    add("--disable-pdl", action="store_true", help="no programmatic dependent launch")
    add("--disable-overlap-schedule", action="store_true")
    add("--compare", choices=["hf"], help="also time transformers generate (GPU)")
    add("--hf-batch-size", type=int, default=64)
    add("--kv-cache-dtype", default=cache.kv_cache_dtype, help="auto, fp8_e4m3 or fp8_e5m2")
    add("--skinny-gemm-max-rows", type=int, default=kernels.skinny_gemm_max_rows)
    add("--triton-decode-max-batch", type=int, default=kernels.triton_decode_max_batch)
    add("--large-decode-min-batch", type=int, default=kernels.large_decode_min_batch,
        help="decode batches of at least this many rows on the large batches' Triton kernel (0: never)")  # fmt: skip
    add("--large-decode-piece-keys", type=int, default=kernels.large_decode_piece_keys,
        help="its keys per piece of a request (0: the unsplit kernel)")  # fmt: skip
    add("--tp-size", type=int, default=1, help="tensor-parallel ranks (one GPU each)")
    add("--max-running-requests", type=int, help="default: the engine's (from its KV pool size)")
    add("--enable-flashinfer-allreduce-fusion", action="store_true")
    add("--symm-mem-allreduce-min-rows", type=int, default=kernels.symm_mem_allreduce_min_rows,
        help="tp > 1: steps of at least this many tokens sum o_proj/down_proj in symmetric "
             "memory (0: never)")  # fmt: skip
    args = parser.parse_args()
    resolve_lengths(parser, args)
    if args.poll_ms is not None and args.poll_ms <= 0:
        parser.error(f"--poll-ms must be > 0, got {args.poll_ms}")
    if args.return_logprob is None:
        args.return_logprob = args.workload in ("rl", "agent")
    if args.compare == "hf" and not torch.cuda.is_available():
        parser.error("--compare hf needs a CUDA GPU (hf_baseline.py runs transformers there)")
    return parser, args


def engine_options(args: argparse.Namespace) -> dict:
    options: dict = {
        "dtype": args.dtype,
        "device": args.device,
        "disable_radix_cache": args.disable_radix_cache,
        "attention_backend": args.attention_backend,
        "disable_cuda_graph": args.disable_cuda_graph,
        "cuda_graph_max_extend_tokens": args.cuda_graph_max_extend_tokens,
        "cuda_graph_max_bs": args.cuda_graph_max_bs,
        "disable_pdl": args.disable_pdl,
        "disable_overlap_schedule": args.disable_overlap_schedule,
        "kv_cache_dtype": args.kv_cache_dtype,
        "skinny_gemm_max_rows": args.skinny_gemm_max_rows,
        "triton_decode_max_batch": args.triton_decode_max_batch,
        "large_decode_min_batch": args.large_decode_min_batch,
        "large_decode_piece_keys": args.large_decode_piece_keys,
        "tp_size": args.tp_size,
        "enable_flashinfer_allreduce_fusion": args.enable_flashinfer_allreduce_fusion,
        "symm_mem_allreduce_min_rows": args.symm_mem_allreduce_min_rows,
    }
    if args.max_total_tokens:
        options["max_total_tokens"] = args.max_total_tokens
    if args.max_running_requests is not None:  # the engine refuses a value below 1
        options["max_running_requests"] = args.max_running_requests
    return options


def poll(engine: RolloutEngine, every_s: float, done: threading.Event, count: list[int]) -> None:
    """As a monitor does: get_server_info every `every_s` seconds until `done` is set."""
    while not done.wait(every_s):
        engine.get_server_info()
        count[0] += 1


def timed_run(engine: RolloutEngine, prompts: list[list[int]], params: list[dict],
              args: argparse.Namespace) -> tuple[list[dict], float, float, dict]:  # fmt: skip
    """Warms up, then generates the workload once (polled with --poll-ms): (outputs, wall
    seconds, the device's busy seconds in that time, the engine's server info afterwards, with
    "polls": how many get_server_info calls the run saw, and "compiled": the Triton kernel
    variants built during the run, by kernel)."""
    return_logprob = args.return_logprob
    # Warm-up with the workload's own sampling settings at its batch width, so that kernels
    # compiled on first use (Triton's sampling variants, the logprob head) are not timed.
    warm = [{**p, "max_new_tokens": 4} for p in params[:64]]
    engine.generate(
        input_ids=[p[:16] for p in prompts[:64]], sampling_params=warm,
        return_logprob=return_logprob,
    )  # fmt: skip
    engine.flush_cache()  # the timed run reuses nothing the warm-up computed
    before = engine.get_server_info()
    busy = before["device_busy_s"]
    done, polls = threading.Event(), [0]
    poller = threading.Thread(target=poll, args=(engine, (args.poll_ms or 0) / 1000, done, polls))
    start = time.perf_counter()
    if args.poll_ms:
        poller.start()
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=return_logprob)
    seconds = time.perf_counter() - start
    done.set()
    if args.poll_ms:
        poller.join()
    info = engine.get_server_info()
    compiled = compiled_between(before, info)
    steps = step_times(before.get("device_busy_by_step", {}), info.get("device_busy_by_step", {}))
    gc = collector_seconds_between(before, info)
    extra = {"polls": polls[0], "compiled": compiled, "steps": steps, "gc_s": gc}
    return outs, seconds, info["device_busy_s"] - busy, {**info, **extra}


def timing(outs: list[dict], seconds: float, busy: float) -> dict:
    """Throughput-independent timings: when samples finished, and the device's idle share."""
    finished = sorted(o["meta_info"]["e2e_latency"] for o in outs)
    at = lambda q: round(finished[min(int(q * len(finished)), len(finished) - 1)], 3)  # noqa: E731
    return {
        "time_to_last_sample_s": round(finished[-1], 3),
        "sample_finish_s": {"p50": at(0.5), "p90": at(0.9), "last": round(finished[-1], 3)},
        "device_busy_s": round(busy, 3),
        "device_idle_fraction": round(max(0.0, 1 - busy / seconds), 4),
    }


def main() -> None:
    parser, args = parse_args()
    options = engine_options(args)
    model = args.model
    if not os.path.isdir(model):
        if model.lower() not in REAL_CONFIGS:
            parser.error(f"--model must be a checkpoint directory or one of {sorted(REAL_CONFIGS)}")
        model = write_config_checkpoint(model.lower(), tempfile.mkdtemp(prefix="rollout-bench-"))
        options["load_format"] = "dummy"

    config = read_config(parser, model)
    # The engine's default context (scheduler_process.py); the exact one is checked once it runs.
    context = config.get("max_position_embeddings", 4096)
    check_context(parser, args, context, "max_position_embeddings in config.json")
    prompts, params = draw(
        args.workload, args.num_seqs, args.input_len, args.output_len, config["vocab_size"],
        args.range_ratio,
    )
    expected_tokens = sum(p["max_new_tokens"] * p.get("n", 1) for p in params)

    with RolloutEngine(model, **options) as engine:
        # Smaller than the config's when the KV pool (--max-total-tokens) is.
        context = engine.get_server_info()["context_length"]
        check_context(parser, args, context, "the engine's context_length")
        outs, seconds, busy, info = timed_run(engine, prompts, params, args)
    output_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    if output_tokens != expected_tokens:
        raise RuntimeError(
            f"the engine generated {output_tokens} tokens, the workload asked for "
            f"{expected_tokens} (ignore_eos): a request was cut short or aborted"
        )
    if args.return_logprob and any(
        len(o["meta_info"]["output_token_logprobs"]) != o["meta_info"]["completion_tokens"]
        for o in outs
    ):
        raise RuntimeError("return_logprob: an output lacks a logprob for one of its tokens")
    result = {
        "workload": args.workload,
        "model": args.model,
        "num_seqs": len(outs),
        "output_tokens": output_tokens,
        "seconds": round(seconds, 3),
        "output_tok_per_s": round(output_tokens / seconds, 1),
        **timing(outs, seconds, busy),
        "return_logprob": args.return_logprob,
        "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
        "device": info["device"],
        "dtype": info["dtype"],
        "kv_cache_dtype": info["kv_cache_dtype"],
        "max_total_tokens": info["max_total_tokens"],
        "max_running_requests": info["max_running_requests"],
        "radix_cache": not args.disable_radix_cache,
        "attention_backend": info["attention_backend"],
        "tp_size": info["tp_size"],
        "decode_attention": info["decode_attention"],
        "cuda_graph": not args.disable_cuda_graph and info["device"].startswith("cuda"),
        "overlap_schedule": not args.disable_overlap_schedule,
        "skinny_gemm_max_rows": args.skinny_gemm_max_rows,
        "pipeline_drains": info["pipeline_drains"],
        "poll_ms": args.poll_ms,
        "polls": info["polls"],
        "retractions": info["retractions"],
        # Triton kernel variants built inside the timed run (the scheduler process's), by kernel.
        "compiled_in_run": info["compiled"],
        "warmup_s": info.get("warmup_s"),  # the engine's, before it reported ready (GPU)
        # The scheduler process's seconds in Python's collections during the run, by generation.
        "scheduler_gc_s": info["gc_s"],
        # Rank 0's device time a step in the timed run, by step kind and decode batch size.
        "steps": info["steps"],
    }
    if args.compare == "hf":
        from benchmarks.hf_baseline import hf_throughput

        # n samples of a prompt are n rows for transformers.
        rows = [(p, q) for p, q in zip(prompts, params) for _ in range(q.get("n", 1))]
        hf = hf_throughput(
            model, [p for p, _ in rows], [q for _, q in rows], args.hf_batch_size, args.dtype
        )
        result.update(hf, speedup=round(result["output_tok_per_s"] / hf["hf_output_tok_per_s"], 2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
