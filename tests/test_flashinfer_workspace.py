"""The FlashInfer backend's workspace: large enough for the split-KV scratch of every plan its
CUDA graphs make (arithmetic only; tests/test_gpu_fast_path.py replays such graphs)."""

from __future__ import annotations

import torch

from rollout.forward.attention.base import AttentionShape
from rollout.forward.attention.flashinfer_backend import (
    MIN_WORKSPACE_BYTES,
    graph_split_bytes,
    workspace_bytes,
)

H200_SMS = 132


def _shape(heads: int, kv_heads: int, graph_rows: int, extend_tokens: int = 512) -> AttentionShape:
    return AttentionShape(
        heads, kv_heads, 128, 1.0, torch.bfloat16, torch.device("cpu"), 2048, 4096,
        max_graph_batch_size=graph_rows, max_graph_extend_tokens=extend_tokens,
        max_graph_extend_requests=32,
    )  # fmt: skip


def test_split_scratch_matches_what_flashinfer_asked_for():
    """FlashInfer 0.6.14 on an H200 refused to plan these graphs in 128 MiB, naming the size of
    its partial outputs (tmp_v); the softmax sums beside them take a 128th of that again."""
    qwen25_7b = _shape(28, 4, 512)
    assert graph_split_bytes(qwen25_7b, 512, 512, H200_SMS) == 168_591_360 * 129 // 128
    qwen3_06b = _shape(16, 8, 1024)
    assert graph_split_bytes(qwen3_06b, 1024, 1024, H200_SMS) == 150_863_872 * 129 // 128


def test_workspace_holds_the_largest_graph_and_never_less_than_the_default():
    for heads, kv_heads, rows in ((28, 4, 1024), (16, 8, 1024), (64, 8, 256), (32, 8, 512)):
        shape = _shape(heads, kv_heads, rows)
        size = workspace_bytes(shape, H200_SMS)
        assert size >= MIN_WORKSPACE_BYTES
        assert size > graph_split_bytes(shape, rows, rows, H200_SMS)
        assert size > graph_split_bytes(shape, 512, 33, H200_SMS)  # the largest extend graph
    # Qwen3-0.6B's default graphs (256 rows) fit FlashInfer's recommendation as they did.
    assert workspace_bytes(_shape(16, 8, 256), H200_SMS) == MIN_WORKSPACE_BYTES


def test_more_rows_need_more_workspace():
    small, large = _shape(28, 4, 512), _shape(28, 4, 1024)
    assert workspace_bytes(large, H200_SMS) > workspace_bytes(small, H200_SMS) > MIN_WORKSPACE_BYTES
