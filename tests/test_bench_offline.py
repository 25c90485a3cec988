"""benchmarks/bench_offline.py as a newcomer first runs it: on the project's tiny model (a
vocabulary of 882 ids, far below the 10,000 the workloads draw from) on the CPU, every workload
runs end to end and prints its throughput; lengths a workload cannot draw from, or that do not
fit the model's context, are refused with a message naming the flag, not a traceback."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_offline.py")
TINY_VOCAB = 882
TINY_CONTEXT = 4096  # max_position_embeddings of `rollout tiny-model`


def run_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def bench():
    """The script as a module, to call main() in-process where no engine starts."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import bench_offline
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    return bench_offline


@pytest.fixture(scope="module")
def workloads(bench):
    """benchmarks/workloads.py, as the script imports it."""
    return sys.modules["benchmarks.workloads"]


def test_the_tiny_model_has_the_small_vocabulary_this_file_is_about(tiny_qwen3):
    with open(os.path.join(tiny_qwen3, "config.json")) as f:
        config = json.load(f)
    assert config["vocab_size"] == TINY_VOCAB
    assert config["max_position_embeddings"] == TINY_CONTEXT


@pytest.mark.parametrize(
    "workload, args, output_tokens",
    [
        ("nano", ["--num-seqs", "2", "--max-len", "100"], 2 * 100),  # lengths 100..100
        ("grpo", ["--num-seqs", "1", "--max-len", "2"], 1 * 8 * 2),  # n=8 samples a prompt
        ("fixed", ["--num-seqs", "2", "--max-len", "4"], 2 * 4),
        ("random", ["--num-seqs", "2", "--input-len", "8", "--output-len", "1"], 2 * 1),
    ],
)
def test_each_workload_runs_on_the_tiny_model_and_reports_its_throughput(
    tiny_qwen3, workload, args, output_tokens
):
    proc = run_bench("--model-path", tiny_qwen3, "--workload", workload, "--device", "cpu", *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["workload"] == workload and result["device"] == "cpu"
    assert result["output_tokens"] == output_tokens  # ignore_eos: every request ran to its end
    assert result["output_tok_per_s"] > 0 and result["seconds"] > 0
    # The timed run's steps by kind: its prefill, and its decode steps by batch size (every
    # request's output but its first token, sampled by the prefill, came from a decode step).
    steps = result["steps"]
    assert steps["extend"]["steps"] >= 1
    decode = [v["steps"] for k, v in steps.items() if k.startswith("decode ")]
    assert set(steps) - {"extend"} == {k for k in steps if k.startswith("decode ")}
    assert sum(decode) >= output_tokens // result["num_seqs"] - 1
    assert all(v["device_ms"] > 0 for v in steps.values())
    # On the CPU a step is computed while it is queued: the host's time is the device's.
    assert all(v["host_ms"] == v["device_ms"] for v in steps.values())


def test_prompt_ids_are_folded_into_the_vocabulary_and_unchanged_where_it_is_large(workloads):
    small, _ = workloads.nano_workload(8, 300, TINY_VOCAB)
    assert max(max(p) for p in small) < TINY_VOCAB
    # With a vocabulary above 10,000 the prompts are nano-vllm's own: randint(0, 10000) draws.
    large, large_params = workloads.nano_workload(8, 300, 151936)
    assert max(max(p) for p in large) >= TINY_VOCAB
    assert [len(p) for p in large] == [len(p) for p in small]
    assert [[t % TINY_VOCAB for t in p] for p in large] == small
    assert all(100 <= q["max_new_tokens"] <= 300 for q in large_params)


def test_the_rl_workload_is_grpo_groups_with_skewed_seeded_lengths(workloads):
    prompts, params = workloads.rl_workload(128, 4096, 151936)
    assert (prompts, params) == workloads.rl_workload(128, 4096, 151936)  # seeded
    assert len(prompts) == len(params) == 128 * 8
    for g in range(128):  # a group's 8 samples are neighbours with one prompt
        assert all(p == prompts[8 * g] for p in prompts[8 * g : 8 * g + 8])
        assert 512 <= len(prompts[8 * g]) <= 1024
    assert len({tuple(p) for p in prompts}) == 128
    assert all(q["temperature"] == 1.0 and q["ignore_eos"] for q in params)
    lengths = sorted(q["max_new_tokens"] for q in params)
    assert 1 <= lengths[0] and lengths[-1] == 4096
    # Many short, a long tail: the median well under the mean, a quarter under 512 tokens,
    # and a few samples run to the cap.
    median, mean = lengths[len(lengths) // 2], sum(lengths) / len(lengths)
    assert median < 1024 < mean < 2048
    assert sum(n < 512 for n in lengths) > len(lengths) // 4
    assert 10 < lengths.count(4096) < 100


def test_the_rl_workload_runs_scaled_down_and_reports_its_timings(workloads, tiny_qwen3):
    proc = run_bench(
        "--model", tiny_qwen3, "--workload", "rl", "--num-seqs", "2", "--max-len", "48",
        "--device", "cpu", "--poll-ms", "2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    _, params = workloads.rl_workload(2, 48, TINY_VOCAB)
    assert result["num_seqs"] == 16
    assert result["output_tokens"] == sum(q["max_new_tokens"] for q in params)
    assert result["return_logprob"] is True  # the bench checks every token got one
    assert result["cached_tokens"] > 0  # a group's samples share their prompt's KV
    finish, seconds = result["sample_finish_s"], result["seconds"]
    assert 0 < finish["p50"] <= finish["p90"] <= finish["last"] <= seconds * 1.01
    assert result["time_to_last_sample_s"] == finish["last"]
    assert 0 < result["device_busy_s"] <= seconds
    # From the unrounded times: the printed ones are rounded to the millisecond.
    idle = 1 - result["device_busy_s"] / seconds
    assert result["device_idle_fraction"] == pytest.approx(idle, abs=0.02)
    # Polled as a monitor polls, and still nothing broke the overlap.
    assert result["polls"] > 0 and result["pipeline_drains"] == 0


def test_the_agent_workload_holds_a_few_long_contexts_among_many_short_ones(workloads):
    prompts, params = workloads.agent_workload(256, 16384, 151936)
    assert (prompts, params) == workloads.agent_workload(256, 16384, 151936)  # seeded
    assert len(prompts) == len(params) == 256 and len({tuple(p) for p in prompts}) == 256
    lengths = sorted(len(p) for p in prompts)
    assert 1 <= lengths[0] and lengths[-1] == 16384
    # Half the contexts under 1/8 of the longest, yet several long ones in the same batch.
    assert lengths[128] < 16384 // 8
    assert 10 <= sum(n >= 8192 for n in lengths) <= 40
    assert all(128 <= q["max_new_tokens"] <= 512 for q in params)
    assert all(q["temperature"] == 1.0 and q["ignore_eos"] for q in params)


def test_the_agent_workload_runs_scaled_down_with_logprobs(workloads, tiny_qwen3):
    proc = run_bench(
        "--model", tiny_qwen3, "--workload", "agent", "--num-seqs", "1", "--max-len", "64",
        "--device", "cpu",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    prompts, params = workloads.agent_workload(1, 64, TINY_VOCAB)
    assert max(len(p) for p in prompts) <= 64
    assert result["num_seqs"] == 1 and result["return_logprob"] is True
    assert result["output_tokens"] == sum(q["max_new_tokens"] for q in params)


def test_a_bad_length_is_a_usage_error_not_a_traceback(tiny_qwen3):
    """The issue's own case: nano draws lengths in 100..max-len, so 32 leaves no range."""
    proc = run_bench("--model", tiny_qwen3, "--workload", "nano", "--max-len", "32", timeout=60)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "--max-len must be >= 100 for --workload nano" in proc.stderr and "got 32" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workload", "fixed", "--input-len", "0"], "--input-len must be >= 1, got 0"),
        (["--workload", "random", "--output-len", "-3"], "--output-len must be >= 1, got -3"),
        (["--workload", "grpo", "--num-seqs", "0"], "--num-seqs must be >= 1, got 0"),
        (["--workload", "random", "--range-ratio", "1.5"],
         "--range-ratio must be in [0, 1], got 1.5"),
        (["--workload", "fixed", "--range-ratio", "0.5"],
         "--range-ratio applies to --workload random"),
        (["--workload", "nano", "--output-len", "5"], "--input-len and --output-len apply to"),
        (["--workload", "nano", "--max-len", "3000"], "--max-len 3000 makes prompts of up to 3000"),
        (["--workload", "grpo", "--max-len", "4000"], "outputs of up to 4000 tokens, 4512 in all"),
        (["--workload", "rl", "--max-len", "3500"], "(prompts are up to 1024 tokens)"),
        (["--workload", "rl", "--input-len", "600"], "--input-len and --output-len apply to"),
        (["--workload", "agent", "--max-len", "3600"], "(replies are up to 512 tokens)"),
        (["--workload", "agent", "--output-len", "64"], "--input-len and --output-len apply to"),
        (["--workload", "nano", "--poll-ms", "0"], "--poll-ms must be > 0, got 0.0"),
        (["--workload", "fixed", "--input-len", "4000", "--output-len", "200"],
         "--input-len 4000 / --output-len 200"),
        (["--workload", "random", "--max-len", "2049"], "over the model's context of 4096 tokens"),
    ],
)  # fmt: skip
def test_lengths_a_workload_cannot_use_are_refused_before_the_engine_starts(
    bench, tiny_qwen3, monkeypatch, capsys, args, message
):
    monkeypatch.setattr(sys, "argv", ["bench_offline.py", "--model", tiny_qwen3, *args])
    monkeypatch.setattr(bench, "RolloutEngine", None)  # calling it would fail the test
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_context_the_kv_pool_shrinks_is_checked_once_the_engine_runs(tiny_qwen3):
    """--max-total-tokens 128 leaves the engine a context of 128 tokens, which config.json does
    not know: the lengths are checked again against the engine's own, and the engine stops."""
    proc = run_bench(
        "--model", tiny_qwen3, "--workload", "fixed", "--max-len", "100",
        "--max-total-tokens", "128", "--device", "cpu",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "over the model's context of 128 tokens (the engine's context_length)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("workload", ["nano", "grpo", "rl", "agent"])
def test_the_simulator_and_the_profiler_draw_the_benchmarks_workloads(
    bench, workloads, monkeypatch, workload
):
    """At their defaults, simulate_schedule.py and profile_workload.py draw the very prompts and
    lengths bench_offline.py runs (their estimates and profiles are of the benchmark's run)."""
    monkeypatch.setattr(sys, "argv", ["bench_offline.py", "--model", "x", "--workload", workload])
    _, args = bench.parse_args()
    want = workloads.draw(workload, args.num_seqs, args.input_len, args.output_len, 151936)
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import profile_workload
        import simulate_schedule
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    given = {"workload": workload, "num_seqs": None, "output_len": None}
    simulated = simulate_schedule.workload(argparse.Namespace(**given, input_len=4096), 151936)
    profiled = profile_workload.pick_workload(argparse.Namespace(**given, input_len=1024), 151936)
    assert simulated == want and profiled == want
