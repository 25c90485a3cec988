"""Tensor-parallel models (CPU, gloo, float32): each rank's shard gives the whole model's logits,
loads exactly its slice of full or pre-sliced weights, and reads only its slice from disk.

Building a rank's shard needs no communication, so the weight checks build every rank in this
process; the forward checks spawn real ranks (tests/tp_worker.py)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.multiprocessing as mp
from tp_worker import run_case, run_rank
from transformers import AutoConfig

import rollout.models.loader as loader
from rollout.forward.tensor_parallel import Shard, TPGroup
from rollout.models.loader import build_model, iter_safetensors, load_model

TOL = 1e-5
SPAWN_TIMEOUT_S = 300


def spawn_ranks(world: int, cases: dict, tmp_path, run=run_case) -> list[dict]:
    """Runs tp_worker.run_rank on `world` spawned ranks, `run` on each case (tp_worker.run_case
    unless another worker module's); their results, by rank. Fails (and kills the ranks) past
    SPAWN_TIMEOUT_S instead of hanging."""
    ctx = mp.start_processes(
        run_rank,
        args=(world, str(tmp_path / "init"), str(tmp_path), cases, run),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    files = [tmp_path / f"rank{rank}.json" for rank in range(world)]
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in ctx.processes:
                    process.kill()
                pytest.fail(f"{world} tensor-parallel ranks did not finish in {SPAWN_TIMEOUT_S} s")
    except mp.ProcessExitedException:
        # A rank that died in gloo's teardown, after every rank wrote its results, checked
        # nothing wrongly; a rank that died before is a failure.
        if not all(f.exists() for f in files):
            raise
        for process in ctx.processes:
            process.kill()
            process.join()
    results = []
    for rank in range(world):
        with open(tmp_path / f"rank{rank}.json") as f:
            results.append(json.load(f))
    return results


@pytest.fixture(scope="module")
def two_ranks(tiny_llama, tiny_qwen2, tiny_qwen3, tmp_path_factory) -> list[dict]:
    cases = {
        "llama": {"path": tiny_llama},
        "qwen2": {"path": tiny_qwen2},
        # Weights pushed after loading, half as full tensors and half pre-sliced.
        "qwen3 perturbed": {"path": tiny_qwen3, "perturb": 0.05},
        # Row-parallel biases (o_proj, down_proj) and column-parallel ones (q/k/v, gate/up).
        "llama biases": {
            "path": tiny_llama,
            "overrides": {"attention_bias": True, "mlp_bias": True},
            "load_format": "dummy",
            "perturb": 0.1,
        },
        # Each row-parallel sum done by the norm after it (forward/all_reduce_norm.py).
        "qwen3 deferred all-reduces": {
            "path": tiny_qwen3, "perturb": 0.05, "defer_all_reduces": True,
        },  # fmt: skip
        # One KV head for two ranks (replicated), and a vocabulary that does not split evenly.
        "qwen2 one kv head, odd vocab": {
            "path": tiny_qwen2,
            "overrides": {"num_key_value_heads": 1, "vocab_size": 883},
            "load_format": "dummy",
            "perturb": 0.1,
        },
    }
    return spawn_ranks(2, cases, tmp_path_factory.mktemp("tp2"))


@pytest.fixture(scope="module")
def four_ranks(tiny_llama, tiny_qwen3, tmp_path_factory) -> list[dict]:
    cases = {
        # 4 query heads, 2 KV heads: each KV head serves two ranks; vocab 882 pads to 4 x 221.
        "qwen3": {"path": tiny_qwen3},
        "llama": {"path": tiny_llama, "perturb": 0.05},
    }
    return spawn_ranks(4, cases, tmp_path_factory.mktemp("tp4"))


def _check_logits(results: list[dict], case: str) -> None:
    for rank, by_case in enumerate(results):
        got = by_case[case]
        assert got["shape"] == got["want_shape"], (rank, got)
        assert got["scale"] > 0.01, f"{case}: logits too small to compare"
        assert got["err"] <= TOL, f"{case}, rank {rank}: max |logit diff| {got['err']:.3g}"


@pytest.mark.parametrize(
    "case", ["llama", "qwen2", "qwen3 perturbed", "llama biases", "qwen2 one kv head, odd vocab"]
)
def test_two_ranks_match_the_whole_model_through_prefill_and_decode(two_ranks, case):
    _check_logits(two_ranks, case)


def test_all_reduces_deferred_to_the_norms_give_the_same_bits(two_ranks):
    # Unfused (gloo, float32), the deferred sums are the same operations in the same order.
    _check_logits(two_ranks, "qwen3 deferred all-reduces")
    for rank in two_ranks:
        got = rank["qwen3 deferred all-reduces"]
        # Both norms of every layer but layer 0's input norm, and the final norm.
        assert got["summing_norms"] == 2 * got["layers"]
        assert got["deferred_diff"] == 0.0


@pytest.mark.parametrize("case", ["qwen3", "llama"])
def test_four_ranks_match_the_whole_model_through_prefill_and_decode(four_ranks, case):
    _check_logits(four_ranks, case)


def test_per_rank_heads_size_the_kv_pool(two_ranks, four_ranks):
    assert [r["llama"]["local_kv_heads"] for r in two_ranks] == [1, 1]
    assert [r["qwen2 one kv head, odd vocab"]["local_kv_heads"] for r in two_ranks] == [1, 1]
    heads = [(r["qwen3"]["local_heads"], r["qwen3"]["local_kv_heads"]) for r in four_ranks]
    assert heads == [(1, 1)] * 4  # 4 query heads, 2 KV heads: one each, replicated


# ---- in-process: building a shard needs no communication -------------------------------------


def ranks(size: int) -> list[TPGroup]:
    return [TPGroup(rank, size) for rank in range(size)]


def expected_slice(full: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    return full if shard is None else shard.take(full)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
@pytest.mark.parametrize("size", [2, 4])
def test_shapes_stay_full_and_loaded_shards_are_slices_of_the_checkpoint(fixture, size, request):
    path = request.getfixturevalue(fixture)
    config = AutoConfig.from_pretrained(path)
    whole = load_model(path, config, torch.float32, "cpu")
    for tp in ranks(size):
        model = load_model(path, config, torch.float32, "cpu", tp=tp)
        assert model.hf_param_shapes() == whole.hf_param_shapes()
        for name, (shape, _) in model.hf_param_shapes(local=True).items():
            want = expected_slice(whole.hf_weight(name), model.hf_shard(name))
            assert shape == tuple(want.shape)
            assert torch.equal(model.hf_weight(name), want), (tp, name)


def test_kv_heads_are_split_or_replicated_by_rank(tiny_qwen3):
    config = AutoConfig.from_pretrained(tiny_qwen3)  # 4 query heads, 2 KV heads of 32
    name = "model.layers.0.self_attn.k_proj.weight"
    split = [build_model(config, torch.float32, "meta", tp).hf_shard(name) for tp in ranks(2)]
    assert [(s.dim, s.start, s.stop) for s in split] == [(0, 0, 32), (0, 32, 64)]
    replicated = [build_model(config, torch.float32, "meta", tp) for tp in ranks(4)]
    assert [m.hf_shard(name).start for m in replicated] == [0, 0, 32, 32]
    q_starts = [m.hf_shard(name.replace("k_proj", "q_proj")).start for m in replicated]
    assert q_starts == [0, 32, 64, 96]


DIVISIBLE = "must be divisible by the tensor-parallel size"


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "intermediate", "message"),
    [
        (4, 2, 3, 128, rf"num_attention_heads \(4\) {DIVISIBLE} 3"),
        (12, 4, 3, 128, rf"num_key_value_heads \(4\) {DIVISIBLE} 3"),
        (12, 4, 6, 128, r"fewer KV heads \(4\) than tensor-parallel ranks \(6\).*multiple"),
        (4, 2, 4, 130, rf"intermediate_size \(130\) {DIVISIBLE} 4"),
    ],
)
def test_unsplittable_shapes_are_clear_errors(
    tiny_llama, heads, kv_heads, size, intermediate, message
):
    config = AutoConfig.from_pretrained(tiny_llama)
    config.num_attention_heads, config.num_key_value_heads = heads, kv_heads
    config.intermediate_size = intermediate
    with pytest.raises(ValueError, match=message):
        build_model(config, torch.float32, "meta", TPGroup(0, size))


def test_loader_reads_only_this_ranks_slice(tiny_llama, monkeypatch):
    whole_reads, sliced_reads = [], []

    class SpyingFile:
        def __init__(self, *args, **kwargs):
            self.file = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            whole_reads.append(name)
            return self.inner.get_tensor(name)

        def get_slice(self, name):
            sliced_reads.append(name)
            return self.inner.get_slice(name)

    real_safe_open = loader.safe_open
    monkeypatch.setattr(loader, "safe_open", SpyingFile)
    config = AutoConfig.from_pretrained(tiny_llama)
    model = load_model(tiny_llama, config, torch.float32, "cpu", tp=TPGroup(1, 2))
    # Everything split is read as a slice; only what each rank holds whole (norms) is read whole.
    assert set(whole_reads) == {n for n in model.hf_param_shapes() if model.hf_shard(n) is None}
    assert all(n.endswith("norm.weight") for n in whole_reads)
    assert set(sliced_reads) == {n for n in model.hf_param_shapes() if model.hf_shard(n)}
    monkeypatch.undo()
    local = model.hf_param_shapes(local=True)
    for name, tensor in iter_safetensors(tiny_llama, shard_of=model.hf_shard):
        assert tuple(tensor.shape) == local[name][0]


NAMES = [
    "model.embed_tokens.weight",  # vocabulary rows (padded at 4 ranks)
    "lm_head.weight",
    "model.layers.1.self_attn.q_proj.weight",  # rows of a fused column-parallel weight
    "model.layers.1.self_attn.k_proj.weight",  # replicated at 4 ranks
    "model.layers.0.self_attn.o_proj.weight",  # row-parallel: columns
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",  # whole on every rank
]


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: model.hf_weight(n).clone() for n in model.hf_param_shapes()}


def _assert_only_changed(model, before, name, want) -> None:
    """`name`'s view holds `want`, every other weight (and the vocabulary padding) is as before."""
    assert torch.equal(model.hf_weight(name), want)
    for other, old in before.items():
        if other != name:
            assert torch.equal(model.hf_weight(other), old), other
    for table in (model.model.embed_tokens.weight, model.lm_head.weight):
        real_rows = model.hf_weight("model.embed_tokens.weight").shape[0]
        assert not table[real_rows:].any(), "vocabulary padding changed"


@pytest.mark.parametrize("size", [2, 4])
def test_load_weights_full_and_presharded_change_exactly_the_shard(tiny_llama, size):
    config = AutoConfig.from_pretrained(tiny_llama)
    whole = load_model(tiny_llama, config, torch.float32, "cpu")
    model = load_model(tiny_llama, config, torch.float32, "cpu", tp=TPGroup(size - 1, size))
    gen = torch.Generator().manual_seed(7)
    for name in NAMES:
        full = torch.randn(whole.hf_param_shapes()[name][0], generator=gen)
        shard = model.hf_shard(name)
        before = _snapshot(model)
        assert model.load_weights([(name, full)]) == {name}
        _assert_only_changed(model, before, name, expected_slice(full, shard))

        piece = torch.randn(model.hf_param_shapes(local=True)[name][0], generator=gen)
        before = _snapshot(model)
        assert model.load_weights([(name, piece)], presharded=True) == {name}
        _assert_only_changed(model, before, name, piece)
        if shard is not None:  # a full tensor is not a slice, and the other way round
            with pytest.raises(ValueError, match=r"this rank's slice"):
                model.load_weights([(name, full)], presharded=True)
            with pytest.raises(ValueError, match=rf"'{name}': expected \[{full.shape[0]}, "):
                model.load_weights([(name, piece)])


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_qwen3"])
@pytest.mark.parametrize("size", [2, 4])
def test_dummy_shards_are_slices_of_the_same_random_model(fixture, size, request):
    path = request.getfixturevalue(fixture)
    config = AutoConfig.from_pretrained(path)
    whole = load_model(path, config, torch.float32, "cpu", load_format="dummy")
    for tp in ranks(size):
        model = load_model(path, config, torch.float32, "cpu", load_format="dummy", tp=tp)
        for name in model.hf_param_shapes():
            want = expected_slice(whole.hf_weight(name), model.hf_shard(name))
            assert torch.equal(model.hf_weight(name), want), (tp, name)


def test_tp_group_ranges():
    assert [TPGroup(r, 4).padded_range(882) for r in range(4)] == [
        (0, 221, 221),
        (221, 442, 221),
        (442, 663, 221),
        (663, 882, 221),
    ]
    assert TPGroup(2, 3).padded_range(4) == (4, 4, 2)  # nothing real left for the last rank
    assert TPGroup(1, 2).even_range(128, "intermediate_size") == (64, 128)
    assert [TPGroup(r, 8).kv_head_range(8, 2) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    single = TPGroup.single()
    x = torch.ones(3)
    assert single.all_reduce(x) is x and single.all_gather(x) is x
    with pytest.raises(ValueError, match="rank must be in"):
        TPGroup(2, 2)


@pytest.mark.parametrize(
    ("device", "placement", "want"),
    [
        ("cuda", {}, "cuda:0"),
        ("cuda", {"base_gpu_id": 1}, "cuda:1"),
        ("cuda", {"gpu_ids": [3]}, "cuda:3"),
        ("cuda:2", {"base_gpu_id": 1}, "cuda:2"),  # a device that names its GPU wins
        ("cpu", {"base_gpu_id": 1}, "cpu"),
    ],
)
def test_one_rank_runs_on_its_base_gpu(tiny_qwen3, device, placement, want):
    # `rollout serve --base-gpu-id 1` puts a single-rank engine on GPU 1 (as SGLang's does),
    # e.g. data-parallel workers started one per GPU.
    from rollout.config import EngineOptions
    from rollout.engine.tp_setup import join_group

    options = EngineOptions.from_kwargs(model_path=tiny_qwen3, device=device, **placement)
    placed, tp = join_group(options, None, 0)
    assert placed.model.device == want and tp.size == 1
