"""Which attention backend runs which decode batch: the small batches' Triton kernel under
FlashInfer, FlashInfer's decode above it, and the large batches' Triton kernels (in long pieces,
or unsplit) from a size on; the plan that chooses them and the hybrid backend that routes each
batch, eager or as a graph of its padded size."""

from __future__ import annotations

import pytest
import torch
from plan_helpers import CPU, CUDA, decode, lengths_batch, plan_for

from rollout.config import KernelOptions
from rollout.engine.cuda_graph_runner import graph_batch_sizes
from rollout.forward import attention
from rollout.forward.attention import DecodeChoice
from rollout.forward.attention.hybrid_backend import HybridAttentionBackend
from rollout.forward.forward_batch import ForwardMode


def test_small_decode_batches_run_on_triton_under_flashinfer_by_default(packages):
    packages("flashinfer", "triton")
    kopts = KernelOptions()
    default, large = kopts.triton_decode_max_batch, kopts.large_decode_min_batch
    assert plan_for(CUDA, torch.bfloat16).decode_attention == DecodeChoice(
        "triton", default, large, kopts.large_decode_piece_keys
    )
    # The default cuts are CUDA-graph batch sizes, so eager and replayed batches route alike.
    assert default in graph_batch_sizes(256) and large in graph_batch_sizes(256)
    none = decode("flashinfer", CUDA, torch.bfloat16, "auto", 0)
    assert none == DecodeChoice("flashinfer", None, large, kopts.large_decode_piece_keys)
    # Elsewhere decode stays on the attention backend itself, for every batch.
    assert decode("triton", CUDA, torch.float32, "auto", 32) == DecodeChoice("triton")
    assert decode("torch", CPU, torch.float32, "auto", 32) == DecodeChoice("torch")
    # Named explicitly, it is that backend for every batch, or a clear error.
    named = decode("flashinfer", CUDA, torch.bfloat16, "triton", 32)
    assert named == DecodeChoice("triton")
    with pytest.raises(ValueError, match="decode_attention_backend='triton' cannot run here: it"):
        decode("torch", CPU, torch.float32, "triton", 32)
    packages("flashinfer")  # without triton, auto keeps decode on flashinfer
    assert decode("flashinfer", CUDA, torch.bfloat16, "auto", 32) == DecodeChoice("flashinfer")


class _Recorder(attention.AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def prepare(self, fb):
        self.calls.append((self.name, "prepare", fb.batch_size))

    def prepare_graph(self, padded_batch_size, fb):
        self.calls.append((self.name, "prepare_graph", padded_batch_size))

    def forward(self, q, k, v, layer, fb, kv_stored=False):
        self.calls.append((self.name, "forward", fb.batch_size))
        return q


def test_hybrid_backend_routes_decode_by_batch_size():
    calls = []
    hybrid = HybridAttentionBackend(_Recorder("extend", calls), _Recorder("decode", calls), decode_max_batch=2)
    assert hybrid.supports_cuda_graph
    for mode, lens in [(ForwardMode.EXTEND, [5]), (ForwardMode.DECODE, [3, 4]), (ForwardMode.DECODE, [3, 4, 5])]:
        fb = lengths_batch(mode, lens)
        hybrid.prepare(fb)
        hybrid.forward(None, None, None, None, fb)
    hybrid.prepare_graph(2, None)  # a graph's batch is its padded size
    hybrid.prepare_graph(4, lengths_batch(ForwardMode.DECODE, [1]))
    assert calls == [
        ("extend", "prepare", 1), ("extend", "forward", 1),
        ("decode", "prepare", 2), ("decode", "forward", 2),
        ("extend", "prepare", 3), ("extend", "forward", 3),
        ("decode", "prepare_graph", 2), ("extend", "prepare_graph", 4),
    ]  # fmt: skip
    # Without a cut, every decode batch is the decode backend's; graphs need both to capture
    # only when the extend backend takes decode batches too.
    calls.clear()
    hybrid = HybridAttentionBackend(attention.create_attention_backend("torch"), _Recorder("decode", calls))
    assert hybrid.supports_cuda_graph
    hybrid.prepare(lengths_batch(ForwardMode.DECODE, [1] * 300))
    assert calls == [("decode", "prepare", 300)]
    cut = HybridAttentionBackend(attention.create_attention_backend("torch"), _Recorder("decode", calls), 8)
    assert not cut.supports_cuda_graph
    with pytest.raises(ValueError, match="decode_max_batch must be >= 1"):
        HybridAttentionBackend(_Recorder("extend", calls), _Recorder("decode", calls), 0)


def test_large_decode_batches_go_to_the_large_batch_kernel_from_its_size_on():
    calls = []
    hybrid = HybridAttentionBackend(
        _Recorder("extend", calls), _Recorder("decode", calls), 2, _Recorder("large", calls), 4
    )
    for lens in ([1, 2], [1, 2, 3], [1] * 4, [1] * 9):
        fb = lengths_batch(ForwardMode.DECODE, lens)
        hybrid.prepare(fb)
        hybrid.forward(None, None, None, None, fb)
    hybrid.prepare_graph(8, None)  # captured as a graph of its padded size
    hybrid.prepare(lengths_batch(ForwardMode.EXTEND, [1] * 9))  # an extend is never the large kernel's
    assert [(name, n) for name, what, n in calls if what != "forward"] == [
        ("decode", 2), ("extend", 3), ("large", 4), ("large", 9), ("large", 8), ("extend", 9),
    ]
    # With the decode backend taking every batch, the large batches' kernel takes the large ones.
    calls.clear()
    every = HybridAttentionBackend(
        _Recorder("extend", calls), _Recorder("decode", calls), None, _Recorder("large", calls), 4
    )
    every.prepare(lengths_batch(ForwardMode.DECODE, [1] * 3))
    every.prepare(lengths_batch(ForwardMode.DECODE, [1] * 4))
    assert calls == [("decode", "prepare", 3), ("large", "prepare", 4)]
    with pytest.raises(ValueError, match="large_min_batch must be >= 1, got 0"):
        HybridAttentionBackend(_Recorder("e", calls), _Recorder("d", calls), 2, _Recorder("u", calls))


def test_the_large_batch_kernel_takes_flashinfers_decode_batches_only(packages):
    packages("flashinfer", "triton")
    plan = plan_for(CUDA, torch.bfloat16, large_decode_min_batch=128)
    assert plan.decode_attention == DecodeChoice("triton", 32, 128, 4096)
    assert plan.decode_attention.large_backend == "triton"
    assert "decode triton up to batch 32, triton in pieces of 4096 keys from batch 128," in str(plan)
    assert attention.supports_cuda_graph(plan.attention_backend, plan.decode_attention)
    unsplit = plan_for(CUDA, torch.bfloat16, large_decode_min_batch=128, large_decode_piece_keys=0)
    assert unsplit.decode_attention == DecodeChoice("triton", 32, 128, 0)
    assert unsplit.decode_attention.large_backend == "deterministic"
    assert "decode triton up to batch 32, unsplit from batch 128," in str(unsplit)
    assert plan_for(CUDA, torch.bfloat16, large_decode_min_batch=128,
                    decode_attention_backend="flashinfer").large_decode_min_batch == 128  # fmt: skip
    # Where FlashInfer runs no decode batch, or no step at all, there is nothing to take over.
    for options in ({"decode_attention_backend": "triton"}, {"attention_backend": "triton"}):
        off = plan_for(CUDA, torch.bfloat16, large_decode_min_batch=128, **options)
        assert (off.large_decode_min_batch, off.large_decode_piece_keys) == (0, 0)
        assert off.decode_attention.large_backend is None
    assert plan_for(CPU, torch.float32, large_decode_min_batch=128).large_decode_min_batch == 0
    # On by default from 80 rows (the CUDA graphs above 64), in pieces of 4,096 keys.
    assert (KernelOptions().large_decode_min_batch, KernelOptions().large_decode_piece_keys) == (80, 4096)
    for name in ("large_decode_min_batch", "large_decode_piece_keys"):
        with pytest.raises(ValueError, match=f"{name} must be >= 0, got -1"):
            KernelOptions(**{name: -1})


def test_the_large_batch_kernel_needs_triton(packages):
    packages("flashinfer")  # no Triton: neither large-batch kernel can run
    assert plan_for(CUDA, torch.bfloat16, large_decode_min_batch=128).large_decode_min_batch == 0
