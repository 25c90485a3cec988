"""The Triton kernels at the real models' sizes in bfloat16, and attention_backend="triton" in
the whole engine (eager and CUDA-graph decode) against the torch backend, on a CUDA GPU.

Shapes: Qwen3-0.6B (16 query / 8 KV heads), Qwen2.5-7B (28 / 4: a GQA group of 7, not a power
of two), Llama-3.1-8B (32 / 8); head dim 128 for all."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from paged_fixtures import make_paged_batch, reference_attention  # noqa: E402

from rollout import RolloutEngine  # noqa: E402
from rollout.engine.sampler import SamplingBatch, apply_penalties_and_masks, sample  # noqa: E402
from rollout.engine.sampling_params import SamplingParams  # noqa: E402
from rollout.models.layers import RMSNorm, apply_rotary  # noqa: E402
from rollout_kernels.decode_attention import choose_num_splits, decode_attention  # noqa: E402
from rollout_kernels.extend_attention import extend_attention  # noqa: E402
from rollout_kernels.rmsnorm import rms_norm  # noqa: E402
from rollout_kernels.rotary import apply_rotary_inplace  # noqa: E402
from rollout_kernels.sampling import sample_tokens  # noqa: E402
from rollout_kernels.silu_and_mul import silu_and_mul  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEADS = {"qwen3-0.6b": (16, 8), "qwen2.5-7b": (28, 4), "llama-3.1-8b": (32, 8)}
BF16_ATTN = {"atol": 1e-2, "rtol": 2e-2}


@pytest.mark.parametrize("model", HEADS)
def test_decode_attention_real_heads_bf16(model):
    heads, kv_heads = HEADS[model]
    rng = random.Random(0)
    seq_lens = [rng.randint(1, 4096) for _ in range(48)] + [8191]
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), heads, kv_heads, 128, torch.bfloat16, "cuda")
    want = reference_attention(batch, 128**-0.5)
    for splits in (1, choose_num_splits(max(seq_lens)), 16):
        out = decode_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices,
            batch.seq_lens, 128**-0.5, num_splits=splits,
        )
        torch.testing.assert_close(out.double().cpu(), want, **BF16_ATTN)


@pytest.mark.parametrize("model", HEADS)
def test_extend_attention_real_heads_bf16(model):
    heads, kv_heads = HEADS[model]
    # A fresh 2048-token prompt, chunks over long cached prefixes, and one-token extends.
    seq_lens, extend_lens = [2048, 3000, 700, 5, 1], [2048, 512, 100, 1, 1]
    batch = make_paged_batch(seq_lens, extend_lens, heads, kv_heads, 128, torch.bfloat16, "cuda", seed=1)
    out = extend_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices,
        batch.seq_lens, batch.extend_lens, batch.extend_starts, max(extend_lens), 128**-0.5,
    )
    torch.testing.assert_close(out.double().cpu(), reference_attention(batch, 128**-0.5), **BF16_ATTN)


@pytest.mark.parametrize("hidden", [1024, 3584, 4096])
def test_rms_norm_real_hidden_bf16(hidden):
    layer = RMSNorm(hidden, 1e-6).cuda().to(torch.bfloat16)
    layer.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(512, hidden, device="cuda", dtype=torch.bfloat16) * 4
    residual = torch.randn_like(x)
    want_out, want_res = layer(x, residual)
    out, res = rms_norm(x, layer.weight, 1e-6, residual=residual)
    assert torch.equal(res, want_res)  # the bf16 sum rounds the same way
    torch.testing.assert_close(out, want_out, atol=1e-2, rtol=8e-3)


def test_rotary_qwen3_heads_bf16():
    t, heads, kv_heads, dim = 1024, 16, 8, 128
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    freqs = torch.arange(t, device="cuda").float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    apply_rotary_inplace(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(k, want_k, atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("intermediate", [3072, 18944, 14336])
def test_silu_and_mul_real_widths_bf16(intermediate):
    x = torch.randn(256, 2 * intermediate, device="cuda", dtype=torch.bfloat16) * 3
    gate, up = x.split(intermediate, dim=-1)
    torch.testing.assert_close(silu_and_mul(x), F.silu(gate) * up, atol=1e-2, rtol=8e-3)


def test_sampling_real_vocab_matches_sampler():
    vocab, rows = 151936, 64
    rng = random.Random(0)
    kinds = [
        lambda: SamplingParams(temperature=0),
        lambda: SamplingParams(temperature=rng.uniform(0.3, 1.5), top_k=rng.choice([1, 20, 50, 1000])),
        lambda: SamplingParams(temperature=rng.uniform(0.3, 1.5), top_p=rng.uniform(0.5, 0.99)),
        lambda: SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05),
        lambda: SamplingParams(temperature=0.8, min_p=0.1),
        lambda: SamplingParams(temperature=1.0),
    ]
    params = [kinds[i % len(kinds)]() for i in range(rows)]
    batch = SamplingBatch.build(
        params, [rng.getrandbits(64) for _ in range(rows)], [[7] * i for i in range(rows)],
        [[1]] * rows, [2], vocab, "cuda",
    )
    logits = torch.randn(rows, vocab, device="cuda") * 3
    want = sample(logits.clone(), batch)
    got = sample_tokens(
        apply_penalties_and_masks(logits.clone(), batch), batch.temperatures, batch.greedy,
        batch.top_ks, batch.top_ps, batch.min_ps, batch.seeds, batch.steps,
        use_top_k=batch.top_k_max > 0, use_top_p=batch.use_top_p, use_min_p=batch.use_min_p,
    )
    assert got.tolist() == want.tolist()


# ---- the engine ---------------------------------------------------------------------------


def _engine_requests(vocab: int) -> tuple[list[list[int]], list[dict]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    # Output budgets differ, so the decode batch shrinks through sizes that pad (11 -> 16 ...);
    # the last two prompts share a 40-token prefix (an extend over a cached prefix).
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 90))] for _ in range(9)]
    prompts += [shared + [5, 6, 7], shared + [8]]
    params = [{"temperature": 0, "ignore_eos": True, "max_new_tokens": 4 + i} for i in range(len(prompts))]
    return prompts, params


def _greedy(path: str, **options) -> list[list[int]]:
    with RolloutEngine(path, dtype="float32", device="cuda", chunked_prefill_size=32, **options) as engine:
        prompts, params = _engine_requests(800)
        engine.generate(input_ids=prompts[-2], sampling_params=params[-2])  # caches the prefix
        return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_engine_triton_backend_greedy_equals_torch_backend_float32(fixture, request):
    path = request.getfixturevalue(fixture)
    want = _greedy(path, attention_backend="torch")
    assert _greedy(path, attention_backend="triton", disable_cuda_graph=True) == want
    assert _greedy(path, attention_backend="triton", cuda_graph_max_bs=16) == want
