"""Short extends replayed from CUDA graphs (engine/extend_graph_runner.py) on a GPU: the same
tokens and logprobs as the same extends launched eagerly, over batches that pad into each kind
of bucket, cached prefixes, prompt logprobs, and decodes running beside them.

The scheduler runs in-process twice over the same requests (bfloat16, tiny checkpoints with the
real models' head size 128): with extend graphs (the default) and with
cuda_graph_max_extend_tokens=0. A graph's FlashInfer plan fixes its query tile by the bucket
(the smallest tile where the bucket has as many request slots as tokens) and always splits the
keys; an eager plan sizes the tile by the batch's mean query length. FlashInfer rounds the
softmax weights to bf16 per tile, so logprobs move by rounding (more than the 0.02 allowed
between a decode graph and eager decode: benchmarks/RESULTS.md, twenty-fourth session): the
comparison allows GRAPH_TOL, and a token may differ only past a near tie.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from rollout import RolloutEngine
from rollout.config import EngineOptions
from rollout.engine.messages import TokenizedRequest
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.scheduler_process import SchedulerProcess
from rollout.forward.attention import package_imports
from rollout.tiny_model import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GRAPH_TOL, GRAPH_TIE = 0.06, 0.12


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_128(request, tmp_path_factory) -> str:
    if not package_imports("flashinfer"):
        pytest.skip("needs flashinfer")
    path = str(tmp_path_factory.mktemp(f"tiny-{request.param}-extend-graphs"))
    return make_tiny_model(path, request.param, seed=4, head_dim=128)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 800) for _ in range(n)]


def _waves() -> list[list[TokenizedRequest]]:
    """Requests added in waves, each wave once the scheduler has stepped the previous one a
    few times: a wave's prompts form one extend step (or a few, past a bucket) while the
    earlier waves decode."""
    rng = random.Random(7)
    history = _ids(rng, 300)
    logprobs = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}

    def req(rid: str, ids: list[int], new: int = 6, **extra) -> TokenizedRequest:
        params = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=new)
        return TokenizedRequest(rid, ids, params, seed=0, **{**logprobs, **extra})

    return [
        # One request per bucket edge: 1 token, a full bucket, one past it (the next bucket).
        [req("one", _ids(rng, 1), new=40), req("long-decode", history, new=60)],
        [req("eight", _ids(rng, 8))],
        [req("nine", _ids(rng, 9))],
        # A turn over a cached history: 20 new tokens extend the cached 300 (no prompt
        # logprobs, which would need the whole prompt computed).
        [req("turn", history + _ids(rng, 20), logprob_start_len=None)],
        [req(f"batch-{i}", _ids(rng, 3 + 9 * i)) for i in range(12)],  # 12 requests, 666 tokens
        [req(f"small-{i}", _ids(rng, 2 + i)) for i in range(8)],  # 8 requests, 44 tokens
        [req("full", _ids(rng, 512)), req("past", _ids(rng, 513))],
        [req(f"many-{i}", _ids(rng, 2)) for i in range(33)],  # more requests than a graph holds
        [req("prompt-only", _ids(rng, 70), new=0)],
    ]


def _run(path: str, extend_tokens: int) -> tuple[dict[str, dict], int]:
    options = EngineOptions.from_kwargs(
        model_path=path, device="cuda", dtype="bfloat16", max_total_tokens=16384,
        cuda_graph_max_extend_tokens=extend_tokens, cuda_graph_max_bs=64,
    )  # fmt: skip
    proc = SchedulerProcess(options)
    sched, runner = proc.scheduler, proc.runner
    replays = [0]
    if runner.extend_graphs is not None:
        replay = runner.extend_graphs.replay

        def counted(fb):
            replays[0] += 1
            return replay(fb)

        runner.extend_graphs.replay = counted
    results: dict[str, dict] = {}
    cached: dict[str, int] = {}

    def collect(done) -> None:
        for req in done:
            out = sched.make_output(req)
            acc = results.setdefault(out.rid, {"ids": []})
            cached[out.rid] = out.cached_tokens
            acc["ids"] += out.new_ids
            columns = out.logprobs.entries() if out.logprobs is not None else {}
            for key, values in columns.items():
                acc.setdefault(key, []).extend(values)

    for wave in _waves():
        for treq in wave:
            sched.add_request(copy.deepcopy(treq))
        for _ in range(3):
            collect(sched.step())
    while sched.has_work():
        collect(sched.step())
    collect(sched.take_reports())
    info = sched.server_info()
    assert info["kv_whole"]
    results["turn"]["cached"] = cached["turn"]
    return results, replays[0]


def _logprob(entry) -> float | None:
    return None if entry is None else entry[0]


def _assert_close(got: dict, want: dict, rid: str) -> None:
    """Same prompt logprobs within GRAPH_TOL; same tokens up to a near tie of the eager run."""
    for key in ("input_token_logprobs",):
        for k, (a, b) in enumerate(zip(got.get(key, []), want.get(key, []))):
            if _logprob(b) is None:
                assert _logprob(a) is None, (rid, key, k)
                continue
            assert abs(_logprob(a) - _logprob(b)) <= GRAPH_TOL, (rid, key, k, a, b)
        assert len(got.get(key, [])) == len(want.get(key, [])), (rid, key)
    top = want.get("output_top_logprobs", [])
    for k, (a, b) in enumerate(zip(got["ids"], want["ids"])):
        lp_a, lp_b = got["output_token_logprobs"][k][0], want["output_token_logprobs"][k][0]
        assert abs(lp_a - lp_b) <= GRAPH_TOL, (rid, k, lp_a, lp_b)
        if a != b:
            gap = top[k][0][0] - top[k][1][0]
            assert gap < GRAPH_TIE, f"{rid} token {k}: {a} != {b} with top-2 gap {gap:.3f}"
            return
    assert len(got["ids"]) == len(want["ids"]), rid


def test_extend_graphs_give_the_eager_extends_tokens_and_logprobs(tiny_128):
    eager, none = _run(tiny_128, extend_tokens=0)
    graphs, replays = _run(tiny_128, extend_tokens=512)
    assert none == 0
    # Every wave but the 666-token batch, the 513-token prompt (with the 512 one: 1,025
    # tokens) and the 33 requests had a step that fits a graph.
    assert replays >= 6, replays
    assert set(graphs) == set(eager)
    assert graphs["turn"]["cached"] >= 256, graphs["turn"]["cached"]  # extended a cached prefix
    for rid in eager:
        _assert_close(graphs[rid], eager[rid], rid)
    # Prompt logprobs covered the whole prompt (a graph's padding rows are never read).
    assert len(graphs["prompt-only"]["input_token_logprobs"]) == 70
    assert len(graphs["nine"]["input_token_logprobs"]) == 9


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_extend_graphs_at_two_ranks_give_the_eager_extends_tokens(tiny_128):
    """Tensor parallelism over NCCL: each rank replays its own captured extend, the all-reduce
    inside the graph; a batch of short prompts, single short prompts and a turn over a cached
    history give what the same tp 2 engine gives with every extend eager."""
    rng = random.Random(11)
    history = _ids(rng, 300)
    batches = [
        [_ids(rng, n) for n in (1, 8, 9, 40, 300)],  # one extend of 358 tokens, 5 requests
        [_ids(rng, 1)],
        [_ids(rng, 9)],
        [history + _ids(rng, 20)],  # 20 new tokens over the cached 300
    ]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}

    def run(extend_tokens: int) -> list[dict]:
        with RolloutEngine(
            tiny_128, device="cuda", dtype="bfloat16", tp_size=2, tp_backend="nccl",
            max_total_tokens=16384, cuda_graph_max_extend_tokens=extend_tokens,
        ) as engine:  # fmt: skip
            plan = engine.get_server_info()["kernel_plan"]
            assert plan["extend_graph_max_tokens"] == extend_tokens, plan
            engine.generate(input_ids=[history], sampling_params=params)  # caches the history
            outs = []
            for k, prompts in enumerate(batches):
                # Prompt logprobs, but not over the cached history (they need it computed).
                start = {} if k == len(batches) - 1 else {"logprob_start_len": 0}
                outs += engine.generate(
                    input_ids=prompts, sampling_params=params, return_logprob=True,
                    top_logprobs_num=2, **start,
                )  # fmt: skip
        return [
            {"ids": o["output_ids"], "cached": o["meta_info"]["cached_tokens"]}
            | {k: v for k, v in o["meta_info"].items() if "logprobs" in k}
            for o in outs
        ]

    eager, graphs = run(0), run(512)
    assert graphs[-1]["cached"] >= 256, graphs[-1]["cached"]
    for k, (got, want) in enumerate(zip(graphs, eager)):
        _assert_close(got, want, f"request {k}")
