"""The CPU-checkable parts of the GPU fast path: the kernel plan (which attention backend runs
extend and decode, fused kernels, skinny GEMM, CUDA graphs, sampling kernel) and its place in
get_server_info, which batch sizes get CUDA graphs and how a batch pads, the KV page list handed
to FlashInfer and its plans' host work, option checks."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
from plan_helpers import CPU, CUDA, lengths_batch, plan_for

from rollout.config import EngineOptions, KernelOptions, option_fields
from rollout.engine.cuda_graph_runner import GraphInputs, graph_batch_sizes, padded_size
from rollout.engine.extend_graph_runner import extend_bucket, extend_token_buckets
from rollout.forward import attention
from rollout.forward.attention import DecodeChoice
from rollout.forward.attention.flashinfer_backend import (
    FlashInferAttentionBackend,
    host_indptr,
    kv_indices,
    speed_up_plans,
    tensor_aware_max,
)
from rollout.forward.forward_batch import ForwardBatch, ForwardMode
from rollout.forward.kernel_plan import SKINNY_MIN_WEIGHT, KernelPlan, resolve_kernel_plan
from rollout.kernel_options import SKINNY_GEMM_MAX_ROWS
from rollout.real_configs import REAL_CONFIGS


def backend(device: torch.device, dtype: torch.dtype, name: str = "auto") -> str:
    return plan_for(device, dtype, attention_backend=name).attention_backend


def test_auto_picks_flashinfer_on_a_gpu_in_half_precision(packages):
    packages("flashinfer", "triton")
    assert backend(CUDA, torch.bfloat16) == "flashinfer"
    assert backend(CUDA, torch.float16) == "flashinfer"


def test_auto_falls_back_where_flashinfer_cannot_run(packages):
    packages("flashinfer", "triton")
    # FlashInfer has no float32 kernels; the CPU has none at all.
    assert backend(CUDA, torch.float32) != "flashinfer"
    assert backend(CPU, torch.bfloat16) == "torch"
    packages()  # nothing beyond torch imports
    assert backend(CUDA, torch.bfloat16) == "torch"


def test_flashinfer_serves_only_the_head_sizes_its_kernels_exist_for(packages):
    # A model of another head size (the tiny test checkpoints' 32) would start, then die in
    # FlashInfer's dispatch at the first decode batch that reached it.
    packages("flashinfer", "triton")

    def plan(head_dim: int, **options) -> KernelPlan:
        engine = EngineOptions.from_kwargs(model_path="m", **options)
        return resolve_kernel_plan(engine, CUDA, torch.bfloat16, head_dim)

    for head_dim in (64, 128, 256):
        assert plan(head_dim).attention_backend == "flashinfer"
    small = plan(32)
    assert (small.attention_backend, small.decode_attention) == ("triton", DecodeChoice("triton"))
    with pytest.raises(ValueError, match="attention_backend='flashinfer' cannot run here: its "
                       "kernels take head_dim 64, 128, 256, the model's is 32"):  # fmt: skip
        plan(32, attention_backend="flashinfer")
    with pytest.raises(ValueError, match="decode_attention_backend='flashinfer'.*is 96"):
        plan(96, attention_backend="triton", decode_attention_backend="flashinfer")


def test_auto_takes_triton_when_registered_and_flashinfer_missing(packages):
    packages("triton")
    expected = "triton" if "triton" in attention.BACKENDS else "torch"
    assert backend(CUDA, torch.bfloat16) == expected


def test_a_named_backend_that_cannot_run_here_says_why(packages):
    packages("flashinfer")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        backend(CPU, torch.bfloat16, "flashinfer")
    with pytest.raises(ValueError, match="got float32"):
        backend(CUDA, torch.float32, "flashinfer")
    packages()
    with pytest.raises(ValueError, match="flashinfer package does not import"):
        backend(CUDA, torch.bfloat16, "flashinfer")
    with pytest.raises(ValueError, match="must be one of auto, flashinfer, triton, torch"):
        backend(CUDA, torch.bfloat16, "fast")
    assert backend(CPU, torch.float32, "torch") == "torch"


def test_the_gpu_backends_bring_the_fused_kernels_and_torch_stays_the_reference(packages):
    packages("flashinfer", "triton")
    gpu = plan_for(CUDA, torch.bfloat16, skinny_gemm_max_rows=8)
    assert gpu.fused_kernels and gpu.sampling_kernel
    assert (gpu.skinny_gemm_max_rows, gpu.skinny_gemm_min_weight) == (8, SKINNY_MIN_WEIGHT)
    default = KernelOptions().skinny_gemm_max_rows
    assert plan_for(CUDA, torch.bfloat16).skinny_gemm_max_rows == default
    assert plan_for(CUDA, torch.bfloat16, skinny_gemm_max_rows=0).skinny_gemm_max_rows == 0
    # The torch backend runs no Triton kernel at all, whatever the skinny option says.
    torch_on_gpu = plan_for(CUDA, torch.bfloat16, attention_backend="torch")
    for ref in (torch_on_gpu, plan_for(CPU, torch.float32)):
        assert not ref.fused_kernels and not ref.sampling_kernel
        assert ref.skinny_gemm_max_rows == 0


def test_sampling_takes_the_kernel_from_a_few_dozen_filtered_rows_or_unfiltered(packages):
    packages("flashinfer", "triton")
    gpu, cpu = plan_for(CUDA, torch.bfloat16), plan_for(CPU, torch.float32)
    rows = gpu.sampling_kernel_min_rows
    assert rows == 32
    assert gpu.samples_with_kernel(1, filtered=False)
    assert not gpu.samples_with_kernel(rows - 1, filtered=True)
    assert gpu.samples_with_kernel(rows, filtered=True)
    assert not cpu.samples_with_kernel(1, filtered=False)
    assert not cpu.samples_with_kernel(rows, filtered=True)


def test_cuda_graphs_where_the_backends_capture_up_to_the_smallest_bound(packages):
    packages("flashinfer", "triton")
    plan = plan_for(CUDA, torch.bfloat16)
    assert plan.cuda_graphs and plan.cuda_graph_max_bs == 1024
    # Unset, the bound is 1024 rows at tp 1 and 512 at tp > 1 (still capped by the requests).
    assert plan_for(CUDA, torch.bfloat16, max_running_requests=2048).cuda_graph_max_bs == 1024
    assert plan_for(CUDA, torch.bfloat16, max_running_requests=700).cuda_graph_max_bs == 700
    assert plan_for(CUDA, torch.bfloat16, tp_size=2, max_running_requests=1024).cuda_graph_max_bs == 512
    assert plan_for(CUDA, torch.bfloat16, tp_size=2, max_running_requests=300).cuda_graph_max_bs == 300
    assert plan_for(CUDA, torch.bfloat16, cuda_graph_max_bs=64).cuda_graph_max_bs == 64
    # Capped by the running requests only: a larger bound asked for is captured.
    assert plan_for(CUDA, torch.bfloat16, max_running_requests=24).cuda_graph_max_bs == 24
    large = plan_for(CUDA, torch.bfloat16, cuda_graph_max_bs=512, max_running_requests=1024)
    assert large.cuda_graph_max_bs == 512
    assert plan_for(CUDA, torch.bfloat16, cuda_graph_max_bs=512, max_running_requests=300).cuda_graph_max_bs == 300
    off = plan_for(CUDA, torch.bfloat16, disable_cuda_graph=True)
    assert (off.cuda_graphs, off.cuda_graph_max_bs) == (False, 0)
    assert not plan_for(CPU, torch.float32).cuda_graphs
    assert not plan_for(CUDA, torch.bfloat16, attention_backend="torch").cuda_graphs
    # torch for extend with triton's decode on every batch captures; with a cut it cannot, as
    # the large decode batches would be torch's.
    whole = {"attention_backend": "torch", "decode_attention_backend": "triton"}
    assert plan_for(CUDA, torch.float32, **whole).cuda_graphs
    assert attention.supports_cuda_graph("torch", DecodeChoice("triton"))
    assert not attention.supports_cuda_graph("torch", DecodeChoice("triton", 8))
    assert attention.supports_cuda_graph("flashinfer", DecodeChoice("triton", 8))


def test_the_registry_says_what_each_backend_class_says_about_graphs():
    from rollout.forward.attention.deterministic_backend import DeterministicAttentionBackend
    from rollout.forward.attention.torch_backend import TorchAttentionBackend
    from rollout.forward.attention.triton_backend import TritonAttentionBackend

    classes = {"torch": TorchAttentionBackend, "triton": TritonAttentionBackend}
    classes["deterministic"] = DeterministicAttentionBackend
    classes["flashinfer"] = FlashInferAttentionBackend  # builds only where flashinfer imports
    for name, cls in classes.items():
        assert attention.BACKENDS[name].cuda_graph is cls.supports_cuda_graph, name
        assert attention.BACKENDS[name].extend_graph is cls.supports_extend_graph, name


def test_short_extends_replay_graphs_where_flashinfer_runs_them(packages):
    packages("flashinfer", "triton")
    assert plan_for(CUDA, torch.bfloat16).extend_graph_max_tokens == 512
    assert plan_for(CUDA, torch.bfloat16, cuda_graph_max_extend_tokens=100).extend_graph_max_tokens == 100
    # No extend is longer than a chunk.
    assert plan_for(CUDA, torch.bfloat16, chunked_prefill_size=64).extend_graph_max_tokens == 64
    # Every rank of a tensor-parallel engine captures them (the all-reduce inside).
    assert plan_for(CUDA, torch.bfloat16, tp_size=2).extend_graph_max_tokens == 512
    off = [
        {"cuda_graph_max_extend_tokens": 0},
        {"disable_cuda_graph": True},
        {"enable_lora": True},  # adapters' segments are planned per extend on the host
        {"attention_backend": "triton"},  # its extend is not captured
    ]
    for options in off:
        assert plan_for(CUDA, torch.bfloat16, **options).extend_graph_max_tokens == 0, options
    assert plan_for(CPU, torch.float32).extend_graph_max_tokens == 0
    with pytest.raises(ValueError, match="cuda_graph_max_extend_tokens must be >= 0, got -1"):
        plan_for(CUDA, torch.bfloat16, cuda_graph_max_extend_tokens=-1)


def test_extend_buckets_keep_padding_under_half_and_hold_every_batch_up_to_the_bound():
    assert extend_token_buckets(512) == [8, 16, 32, 64, 128, 192, 256, 384, 512]
    assert extend_token_buckets(100) == [8, 16, 32, 64, 100]
    assert extend_token_buckets(8) == [8]
    assert extend_token_buckets(5) == [5]
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        extend_token_buckets(0)
    buckets = extend_token_buckets(512)
    for tokens in range(1, 513):
        for requests in (1, min(tokens, 32)):
            got = extend_bucket(buckets, 32, requests, tokens)
            assert got is not None and tokens <= got and min(32, got) >= requests
            smaller = [b for b in buckets if b < got]
            assert not smaller or smaller[-1] < tokens
            assert got == 8 or got - tokens < got // 2
    assert extend_bucket(buckets, 32, 1, 513) is None  # past the largest: eager
    assert extend_bucket(buckets, 32, 33, 100) is None  # more requests than a graph holds
    assert extend_bucket(buckets, 4, 5, 100) is None  # the bound is the runner's


def test_plan_reads_as_one_line_and_a_json_dict(packages):
    packages("flashinfer", "triton")
    plan = plan_for(CUDA, torch.bfloat16)
    assert json.loads(json.dumps(plan.as_dict())) == {
        "attention_backend": "flashinfer", "decode_backend": "triton", "decode_max_batch": 32,
        "fused_kernels": True, "skinny_gemm_max_rows": 16,
        "skinny_gemm_min_weight": SKINNY_MIN_WEIGHT,
        "cuda_graphs": True, "cuda_graph_max_bs": 1024, "sampling_kernel": True,
        "sampling_kernel_min_rows": 32, "deterministic_inference": False,
        "sampling_per_filter_set": False, "logprob_kernel": True,
        "allreduce_fusion": False, "symm_mem_allreduce_min_rows": 0,
        "symm_mem_allreduce_max_rows": 0, "programmatic_launch": False,
        "extend_graph_max_tokens": 512, "lora_overlap_max_rows": 0, "large_decode_min_batch": 80,
        "large_decode_piece_keys": 4096,
    }  # fmt: skip
    assert str(plan) == (
        "attention flashinfer, decode triton up to batch 32, triton in pieces of 4096 keys from "
        "batch 80, fused kernels on, skinny GEMM up to 16 rows, CUDA graphs up to batch 1024 and extends up to 512 tokens, sampling kernel"
    )


def test_lora_runs_beside_the_gemms_only_with_adapters_on_a_gpu(packages):
    packages("flashinfer", "triton")
    assert KernelOptions().lora_overlap_max_rows == 128
    gpu = plan_for(CUDA, torch.bfloat16, enable_lora=True)
    assert gpu.lora_overlap_max_rows == 128
    assert str(gpu).endswith(", LoRA beside the GEMMs up to 128 rows")
    assert plan_for(CUDA, torch.bfloat16, enable_lora=True, lora_overlap_max_rows=4).lora_overlap_max_rows == 4
    assert plan_for(CUDA, torch.bfloat16, enable_lora=True, lora_overlap_max_rows=0).lora_overlap_max_rows == 0
    assert plan_for(CUDA, torch.bfloat16).lora_overlap_max_rows == 0  # no adapters
    assert plan_for(torch.device("cpu"), torch.float32, enable_lora=True).lora_overlap_max_rows == 0


def test_allreduce_fusion_runs_where_gpu_ranks_can_and_is_refused_clearly_elsewhere(packages):
    packages("flashinfer", "triton")
    fusion = {"enable_flashinfer_allreduce_fusion": True}
    plan = plan_for(CUDA, torch.bfloat16, tp_size=2, **fusion)
    assert plan.allreduce_fusion and str(plan).endswith(", all-reduce fused with the norms")
    assert plan_for(CUDA, torch.float16, tp_size=2, **fusion).allreduce_fusion
    assert not plan_for(CUDA, torch.bfloat16, tp_size=2).allreduce_fusion  # not asked
    assert not plan_for(CUDA, torch.bfloat16, **fusion).allreduce_fusion  # tp 1: nothing to fuse
    refusals = [
        (CPU, torch.bfloat16, {}, "on GPUs over NCCL"),
        (CUDA, torch.bfloat16, {"tp_backend": "gloo"}, "on GPUs over NCCL"),
        (CUDA, torch.float32, {}, "bfloat16 or float16, got float32"),
    ]
    for device, dtype, extra, why in refusals:
        with pytest.raises(ValueError, match=f"enable_flashinfer_allreduce_fusion needs.*{why}"):
            plan_for(device, dtype, tp_size=2, **fusion, **extra)
    packages("triton")
    with pytest.raises(ValueError, match="pip install flashinfer-python"):
        plan_for(CUDA, torch.bfloat16, tp_size=2, attention_backend="triton", **fusion)


def test_symmetric_memory_sums_only_gpu_ranks_forwards_within_the_longest_step(packages):
    packages("flashinfer", "triton")
    assert KernelOptions().symm_mem_allreduce_min_rows == 0  # off until measured
    assert plan_for(CUDA, torch.bfloat16, tp_size=2).symm_mem_allreduce_min_rows == 0
    symm = {"symm_mem_allreduce_min_rows": 4096}
    plan = plan_for(CUDA, torch.bfloat16, tp_size=2, **symm)
    # The buffer holds the longest extend: chunked_prefill_size 8192 under max_prefill_tokens.
    assert (plan.symm_mem_allreduce_min_rows, plan.symm_mem_allreduce_max_rows) == (4096, 8192)
    assert str(plan).endswith(", symmetric-memory all-reduce from 4096 to 8192 rows")
    fusion = {"enable_flashinfer_allreduce_fusion": True}
    both = plan_for(CUDA, torch.bfloat16, tp_size=2, **fusion, **symm)
    assert both.allreduce_fusion and both.symm_mem_allreduce_min_rows == 4096
    shorter = plan_for(CUDA, torch.bfloat16, tp_size=2, max_prefill_tokens=6000, **symm)
    assert shorter.symm_mem_allreduce_max_rows == 6000
    # ... or a decode of every running request, where that has more rows.
    running = plan_for(CUDA, torch.bfloat16, tp_size=2, chunked_prefill_size=256,
                       max_running_requests=1024, symm_mem_allreduce_min_rows=128)  # fmt: skip
    assert running.symm_mem_allreduce_max_rows == 1024
    zeroed = [
        plan_for(CUDA, torch.bfloat16, **symm),  # tp 1: nothing to sum
        plan_for(CPU, torch.float32, tp_size=2, **symm),
        plan_for(CUDA, torch.float32, tp_size=2, tp_backend="gloo", **symm),
        plan_for(CUDA, torch.bfloat16, tp_size=2, chunked_prefill_size=2048, **symm),  # no step
        plan_for(CUDA, torch.bfloat16, enable_deterministic_inference=True, **symm),
    ]
    for plan in zeroed:
        assert (plan.symm_mem_allreduce_min_rows, plan.symm_mem_allreduce_max_rows) == (0, 0)
        assert "symmetric" not in str(plan)


def test_options_validate_backend_and_graph_size():
    assert KernelOptions().attention_backend == "auto"
    assert KernelOptions().disable_cuda_graph is False
    with pytest.raises(ValueError, match="attention_backend must be one of auto, flashinfer"):
        KernelOptions(attention_backend="flash")
    assert KernelOptions().decode_attention_backend == "auto"
    with pytest.raises(ValueError, match="decode_attention_backend must be one of auto, flashinfer"):
        KernelOptions(decode_attention_backend="fi")
    assert KernelOptions().skinny_gemm_max_rows == 16  # decode batches of up to 16 rows
    with pytest.raises(ValueError, match="skinny_gemm_max_rows must be in 0..16, got 17"):
        KernelOptions(skinny_gemm_max_rows=17)
    with pytest.raises(ValueError, match="lora_overlap_max_rows must be >= 0, got -1"):
        KernelOptions(lora_overlap_max_rows=-1)
    with pytest.raises(ValueError, match="symm_mem_allreduce_min_rows must be >= 0, got -1"):
        EngineOptions.from_kwargs(model_path="m", symm_mem_allreduce_min_rows=-1)
    with pytest.raises(ValueError, match="triton_decode_max_batch must be >= 0, got -1"):
        KernelOptions(triton_decode_max_batch=-1)
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be >= 1, got 0"):
        KernelOptions(cuda_graph_max_bs=0)
    opts = EngineOptions.from_kwargs(model_path="m", disable_cuda_graph=True, cuda_graph_max_bs=64)
    assert opts.kernels.disable_cuda_graph and opts.kernels.cuda_graph_max_bs == 64
    # The flat names (engine keywords and CLI flags) are unchanged by the grouping.
    flat = [f.name for f in option_fields()]
    routing = [f.name for f in dataclasses.fields(KernelOptions)]
    assert routing == [
        "attention_backend", "decode_attention_backend", "triton_decode_max_batch",
        "large_decode_min_batch", "large_decode_piece_keys", "skinny_gemm_max_rows", "lora_overlap_max_rows", "disable_cuda_graph", "disable_pdl",
        "cuda_graph_max_bs",
        "cuda_graph_max_extend_tokens", "enable_deterministic_inference",
        "enable_flashinfer_allreduce_fusion", "symm_mem_allreduce_min_rows",
    ]  # fmt: skip
    assert set(routing) <= set(flat) and len(flat) == len(set(flat))
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineOptions.from_kwargs(model_path="m", attention_backend="flash")


def test_the_skinny_row_bound_is_the_kernels_own():
    pytest.importorskip("triton")
    from rollout_kernels.skinny_gemm import MAX_ROWS

    assert SKINNY_GEMM_MAX_ROWS == MAX_ROWS


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 20
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        graph_batch_sizes(0)


def test_every_batch_pads_to_the_smallest_graph_that_holds_it():
    sizes = graph_batch_sizes(100)
    for b in range(1, 101):
        bs = padded_size(sizes, b)
        assert bs >= b and bs - b < 16
        assert all(s < b for s in sizes if s < bs)
    assert padded_size(sizes, 101) is None


def _decode_batch(table: torch.Tensor, rows: list[int], lens: list[int]) -> ForwardBatch:
    b = len(rows)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(b, dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in lens]),
        out_cache_loc=torch.zeros(b, dtype=torch.int64),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(lens),
        extend_lens=torch.ones(b, dtype=torch.int64),
        req_to_token=table,
        kv_pool=None,
        attn_backend=None,
        seq_lens_cpu=lens,
        extend_lens_cpu=[1] * b,
    )


def test_kv_page_list_is_each_requests_slots_in_order():
    table = torch.arange(1, 5 * 10 + 1).view(5, 10)  # row r holds slots 10r+1 .. 10r+10
    rows, lens = [3, 0, 4], [4, 1, 7]
    fb = _decode_batch(table, rows, lens)
    indptr = host_indptr(lens)
    assert indptr.tolist() == [0, 4, 5, 12] and indptr.dtype == torch.int32
    got = kv_indices(fb, int(indptr[-1]))
    want = torch.cat([table[r, :n] for r, n in zip(rows, lens)])
    assert got.dtype == torch.int32 and got.tolist() == want.tolist()


def test_fp8_e4m3_kv_needs_a_gpu_that_converts_it(monkeypatch):
    from rollout.forward.kv_pool import check_kv_dtype_runs, kv_cache_dtype

    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"fp8_e4m3.*compute capability 8.9 or newer, got 8.0 \(NVIDIA A100\)"):
        check_kv_dtype_runs(torch.float8_e4m3fn, CUDA)
    check_kv_dtype_runs(torch.float8_e5m2, CUDA)  # e5m2 converts on older GPUs too
    check_kv_dtype_runs(torch.float8_e4m3fn, CPU)  # torch converts on the host
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_kv_dtype_runs(torch.float8_e4m3fn, CUDA)


def test_skinny_gemm_takes_the_large_projections_of_a_batch_1_decode():
    # Qwen2.5-7B's shapes (built without storage): at one row its q/k/v and o projections
    # keep torch's GEMM, which reads them faster; gate/up, down and the LM head take the
    # skinny kernel. Switching the kernels off again clears every choice.
    from transformers import AutoConfig

    from rollout.models import get_model_class
    from rollout.models.layers import use_fused_kernels

    cfg = AutoConfig.for_model(**REAL_CONFIGS["qwen2.5-7b"])
    with torch.device("meta"):
        model = get_model_class(cfg)(cfg)
    use_fused_kernels(model, True, skinny_rows=1)
    layer = model.model.layers[0]
    assert (layer.self_attn.qkv_proj.skinny_rows, layer.self_attn.o_proj.skinny_rows) == (0, 0)
    assert (layer.mlp.gate_up_proj.skinny_rows, layer.mlp.down_proj.skinny_rows, model.skinny_rows) == (1, 1, 1)
    use_fused_kernels(model, True, skinny_rows=1, skinny_min_weight=0)
    assert layer.self_attn.qkv_proj.skinny_rows == 1
    use_fused_kernels(model, False, skinny_rows=1)
    assert not any(getattr(m, "skinny_rows", 0) for m in model.modules())


def test_plans_take_the_max_of_a_length_tensor_without_walking_it(monkeypatch):
    """FlashInfer's plan() runs `max(kv_lens).item()` on a host tensor every decode step; with
    speed_up_plans that is one tensor op, with the builtin's result, and the builtin elsewhere
    is untouched."""
    plans = types.ModuleType("decode")
    exec("def max_kv_len(kv_lens):\n    return max(kv_lens).item()", plans.__dict__)
    speed_up_plans(types.SimpleNamespace(decode=plans))
    lens = torch.tensor([7, 1030, 3, 1030, 12], dtype=torch.int32)
    expected = max(lens).item()
    monkeypatch.setattr(torch.Tensor, "__iter__", lambda self: pytest.fail("walked the tensor"))
    assert plans.max_kv_len(lens) == expected == 1030
    # Every other form still answers as the builtin does.
    assert tensor_aware_max(3, 8, 5) == 8
    assert tensor_aware_max([4, 2], key=lambda x: -x) == 2
    assert tensor_aware_max([], default=-1) == -1


def test_server_info_reports_the_plan_the_engine_runs(tiny_qwen3):
    from rollout import RolloutEngine

    # Flat keywords as ever; on the CPU the torch reference runs whatever else was asked for.
    options = {"skinny_gemm_max_rows": 4, "cuda_graph_max_bs": 8, "triton_decode_max_batch": 0}
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cpu", **options) as engine:
        info = engine.get_server_info()
        assert engine.options.kernels == KernelOptions(**options)
    expected = resolve_kernel_plan(engine.options, CPU, torch.float32)
    assert info["kernel_plan"] == expected.as_dict()
    assert info["kernel_plan"]["attention_backend"] == "torch"
    assert not info["kernel_plan"]["cuda_graphs"] and not info["kernel_plan"]["fused_kernels"]
    assert (info["attention_backend"], info["decode_attention"]) == ("torch", "torch")


def test_graph_rows_hold_the_batch_then_padding_at_fixed_addresses():
    from rollout.forward.attention.base import AttentionShape, GraphRows

    shape = AttentionShape(2, 1, 8, 1.0, torch.float32, torch.device("cpu"), 4, 16)
    rows = GraphRows(shape)
    seq_lens, req_rows = rows.fill(4, lengths_batch(ForwardMode.DECODE, [5, 7, 9]))
    assert seq_lens.tolist() == [5, 7, 9, 0] and req_rows.tolist() == [0, 1, 2, 0]
    # A later, smaller batch replays the same graph: what the last one left is padded over.
    again, _ = rows.fill(4, lengths_batch(ForwardMode.DECODE, [3]))
    assert again.tolist() == [3, 0, 0, 0] and again.data_ptr() == seq_lens.data_ptr()
    with pytest.raises(ValueError, match="exceeds max_batch_size 4"):
        rows.fill(5, None)


def test_kernels_launch_with_pdl_on_hopper_gpus_unless_disabled(packages, monkeypatch):
    packages("flashinfer", "triton")
    from rollout.forward import kernel_plan

    monkeypatch.setattr(kernel_plan, "gpu_capability", lambda device: (9, 0))
    plan = plan_for(CUDA, torch.bfloat16)
    assert plan.programmatic_launch and str(plan).endswith(", programmatic dependent launch")
    assert not plan_for(CUDA, torch.bfloat16, disable_pdl=True).programmatic_launch
    assert not plan_for(CUDA, torch.bfloat16, attention_backend="torch").programmatic_launch
    assert not plan_for(CPU, torch.float32).programmatic_launch
    monkeypatch.setattr(kernel_plan, "gpu_capability", lambda device: (8, 0))  # an A100
    assert not plan_for(CUDA, torch.bfloat16).programmatic_launch


def test_graph_inputs_hold_the_batch_then_padding_that_writes_slot_0():
    """A replay's inputs: the batch's tokens first, then padding whose KV goes to slot 0 even
    where a longer batch before it left its slots (now maybe another request's)."""
    inputs = GraphInputs(16, CPU)

    def batch(ids: list[int], slots: list[int]):
        ints = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        positions = ints(range(len(ids)))
        return types.SimpleNamespace(input_ids=ints(ids), positions=positions, out_cache_loc=ints(slots))

    inputs.fill(batch([5, 6, 7, 8, 9, 10], [21, 22, 23, 24, 25, 26]), rows=8)
    assert inputs.out_cache_loc[:8].tolist() == [21, 22, 23, 24, 25, 26, 0, 0]
    inputs.fill(batch([40, 41], [31, 32]), rows=8)
    assert inputs.input_ids[:2].tolist() == [40, 41]
    assert inputs.positions[:2].tolist() == [0, 1]
    assert inputs.out_cache_loc[:8].tolist() == [31, 32, 0, 0, 0, 0, 0, 0]


class _RecordingWrapper:
    """Stands in for FlashInfer's wrappers: keeps what it was built with and each plan."""

    def __init__(self, workspace, layout, **kwargs) -> None:
        self.kwargs = kwargs
        self.plans: list[tuple[tuple, dict]] = []

    def plan(self, *args, **kwargs) -> None:
        self.plans.append((args, kwargs))


def test_an_extend_graph_plans_the_batch_then_empty_slots_then_the_padding(monkeypatch):
    """What a captured extend's FlashInfer plan is given: the batch's requests, empty request
    slots up to the graph's count, and one request of the padding tokens over KV slot 0."""
    import sys

    fake = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=_RecordingWrapper,
        BatchPrefillWithPagedKVCacheWrapper=_RecordingWrapper,
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    shape = attention.AttentionShape(
        num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5, dtype=torch.bfloat16,
        device=CPU, max_batch_size=8, max_context_len=10,
    )  # fmt: skip
    backend = FlashInferAttentionBackend(shape)
    backend.prepare_extend_graph(16, 4, None)  # the capture: every token is padding
    wrapper = backend._extend
    assert wrapper is not backend.extend_wrapper and wrapper.kwargs["use_cuda_graph"]
    assert len(wrapper.kwargs["qo_indptr_buf"]) == 4 + 2  # 4 slots, the padding's, the end
    (qo, kv, indices, last), kwargs = wrapper.plans[-1][0][:4], wrapper.plans[-1][1]
    assert qo.tolist() == [0, 0, 0, 0, 0, 16] and kv.tolist() == [0, 0, 0, 0, 0, 16]
    assert indices.tolist() == [0] * 16 and last.tolist() == [1] * 5 and kwargs["causal"]

    # Two requests: 3 new tokens after 2 cached (row 3), 4 new ones (row 1): 7 of 16 tokens.
    table = torch.arange(1, 5 * 10 + 1).view(5, 10)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=torch.zeros(7, dtype=torch.int64),
        positions=torch.tensor([2, 3, 4, 0, 1, 2, 3]), out_cache_loc=torch.zeros(7, dtype=torch.int64),
        req_pool_indices=torch.tensor([3, 1]), seq_lens=torch.tensor([5, 4]),
        extend_lens=torch.tensor([3, 4]), req_to_token=table, kv_pool=None, attn_backend=None,
        seq_lens_cpu=[5, 4], extend_lens_cpu=[3, 4],
    )  # fmt: skip
    backend.prepare_extend_graph(16, 4, fb)
    assert backend._extend is wrapper  # the same graph's wrapper, planned again
    qo, kv, indices, last = wrapper.plans[-1][0][:4]
    assert qo.tolist() == [0, 3, 7, 7, 7, 16]
    assert kv.tolist() == [0, 5, 9, 9, 9, 18]
    assert indices.tolist() == table[3, :5].tolist() + table[1, :4].tolist() + [0] * 9
    with pytest.raises(ValueError, match="exceeds the graph's 1 requests and 16 tokens"):
        backend.prepare_extend_graph(16, 1, fb)  # a smaller graph of its own, too few slots
    with pytest.raises(ValueError, match="largest first"):
        backend.prepare_extend_graph(32, 4, None)
    backend.prepare(fb)  # an eager extend plans the eager wrapper and runs on it
    assert backend._extend is backend.extend_wrapper
