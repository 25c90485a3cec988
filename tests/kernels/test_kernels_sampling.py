"""The sampling kernel draws the same tokens as the torch sampler (same filters, same hashed
Gumbel noise), for every mix of greedy, temperature, top-k, top-p and min-p rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rollout.engine.sampler import SamplingBatch, apply_penalties_and_masks, sample  # noqa: E402
from rollout.engine.sampling_params import SamplingParams  # noqa: E402
from rollout_kernels.sampling import sample_tokens  # noqa: E402

VOCAB = 1000  # not a power of two: the last block of every pass is partly masked


def _kernel_sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    return sample_tokens(
        apply_penalties_and_masks(logits.clone(), batch), batch.temperatures, batch.greedy,
        batch.top_ks, batch.top_ps, batch.min_ps, batch.seeds, batch.steps,
        use_top_k=batch.top_k_max > 0, use_top_p=batch.use_top_p, use_min_p=batch.use_min_p,
        block=256,
    )


def _batch(
    params: list[SamplingParams], seeds: list[int], steps: list[int], device: str, per_filter_set: bool = False
) -> SamplingBatch:
    outputs = [[5] * n for n in steps]
    return SamplingBatch.build(
        params, seeds, outputs, [[1]] * len(params), [2], VOCAB, device, per_filter_set=per_filter_set
    )


ROWS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.0, top_p=0.05),
    SamplingParams(temperature=1.1, top_k=50, top_p=0.9),
    SamplingParams(temperature=0.8, min_p=0.1),
    SamplingParams(temperature=1.2, top_k=200, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=0.5, top_k=VOCAB + 10),  # larger than V: no cut
]


def test_mixed_rows_draw_the_sampler_tokens(device):
    gen = torch.Generator().manual_seed(0)
    seeds = [11, 2**64 - 3, 7, 123456789, 0, 5, 99, 2**40 + 1, 17, 3]
    for trial in range(3):
        logits = torch.randn(len(ROWS), VOCAB, generator=gen).to(device)
        batch = _batch(ROWS, seeds, [trial * 3 + i for i in range(len(ROWS))], device)
        want = sample(logits.clone(), batch)
        got = _kernel_sample(logits, batch)
        assert got.tolist() == want.tolist()


def test_many_seeds_cover_the_distribution_like_the_sampler(device):
    # One row repeated with different seeds: the kernel must reproduce every draw, so the two
    # empirical distributions are the same, not just close.
    logits = torch.linspace(-3, 3, VOCAB).roll(137)[None, :].repeat(24, 1).to(device)
    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.9)] * 24
    batch = _batch(params, list(range(1000, 1024)), [0] * 24, device)
    want = sample(logits.clone(), batch)
    got = _kernel_sample(logits, batch)
    assert got.tolist() == want.tolist()
    assert len(set(got.tolist())) > 3  # the noise does vary with the seed


def test_top_k_keeps_ties_at_the_cut_and_banned_tokens_never_drawn(device):
    gen = torch.Generator().manual_seed(1)
    # Integer logits: many exact ties, including at the k-th value.
    logits = torch.randint(-4, 4, (8, VOCAB), generator=gen).float().to(device)
    logits[:, 3] = 10.0  # would always win, but row 0..7 ban it below
    params = [SamplingParams(temperature=1.0, top_k=k, min_new_tokens=5, stop_token_ids=[3]) for k in (1, 2, 3, 7, 40, 300, 999, -1)]
    batch = _batch(params, list(range(8)), [0] * 8, device)
    want = sample(logits.clone(), batch)
    got = _kernel_sample(logits, batch)
    assert got.tolist() == want.tolist()
    assert 3 not in got.tolist()


def test_greedy_rows_take_the_first_maximum(device):
    logits = torch.zeros(2, VOCAB, device=device)
    logits[0, [700, 40, 999]] = 1.0
    logits[1, VOCAB - 1] = 2.0
    batch = _batch([SamplingParams(temperature=0)] * 2, [0, 0], [0, 0], device)
    assert _kernel_sample(logits, batch).tolist() == [40, VOCAB - 1]


@pytest.mark.parametrize("filtered", [True, False])
def test_first_maximum_across_blocks_and_within_a_lane(device, filtered):
    # Block 128: 44, 172 and 300 sit in one lane of three blocks; 130 and 200 in two lanes.
    # However the kernels combine blocks and lanes, the first maximum must win (torch.argmax).
    logits = torch.zeros(3, VOCAB, device=device)
    logits[0, [300, 172, 44]] = 1.0
    logits[1, [200, 130]] = 1.0
    logits[2, [300, 130, 172]] = 1.0
    batch = _batch([SamplingParams(temperature=0)] * 3, [0] * 3, [0] * 3, device)
    got = sample_tokens(
        logits, batch.temperatures, batch.greedy, batch.top_ks, batch.top_ps, batch.min_ps,
        batch.seeds, batch.steps, use_top_k=filtered, use_top_p=False, use_min_p=False,
        block=128, chunk=256,
    )
    assert got.tolist() == [44, 130, 130]


def test_unfiltered_rows_drawn_in_chunks_are_the_sampler_tokens(device):
    # Temperature only: each row is cut into chunks (4 of 256 here) drawn by programs of their
    # own; the winner must be the one-pass sampler's token, greedy rows included.
    gen = torch.Generator().manual_seed(2)
    params = [SamplingParams(temperature=t) for t in (0.6, 1.0, 0, 1.7, 0.3, 0, 1.0, 2.5)]
    seeds = [3, 2**64 - 1, 0, 41, 2**33, 8, 1000, 77]
    for trial in range(3):
        logits = torch.randn(len(params), VOCAB, generator=gen).mul(3).to(device)
        batch = _batch(params, seeds, [trial * 5 + i for i in range(len(params))], device)
        assert not (batch.top_k_max or batch.use_top_p or batch.use_min_p)
        want = sample(logits.clone(), batch)
        for chunk in (256, 300, 8192):  # several chunks, a chunk rounded up to whole blocks, one
            got = sample_tokens(
                logits.clone(), batch.temperatures, batch.greedy, batch.top_ks, batch.top_ps,
                batch.min_ps, batch.seeds, batch.steps,
                use_top_k=False, use_top_p=False, use_min_p=False, block=128, chunk=chunk,
            )
            assert got.tolist() == want.tolist(), chunk


def test_chunked_greedy_takes_the_first_maximum_across_chunks(device):
    logits = torch.zeros(3, VOCAB, device=device)
    logits[0, [900, 300, 700]] = 1.0  # equal maxima in different chunks: the first wins
    logits[1, :] = float("-inf")  # nothing drawable: token 0, as the one-pass kernel gives
    logits[2, VOCAB - 1] = 5.0  # in the last, partly masked chunk
    batch = _batch([SamplingParams(temperature=0)] * 3, [0] * 3, [0] * 3, device)
    got = sample_tokens(
        logits, batch.temperatures, batch.greedy, batch.top_ks, batch.top_ps, batch.min_ps,
        batch.seeds, batch.steps, use_top_k=False, use_top_p=False, use_min_p=False,
        block=128, chunk=256,
    )
    assert got.tolist() == [300, 0, VOCAB - 1]


def test_rejects_per_row_tensors_of_the_wrong_length(device):
    logits = torch.zeros(2, VOCAB, device=device)
    b = _batch([SamplingParams()] * 3, [0] * 3, [0] * 3, device)
    with pytest.raises(ValueError, match="one value per row"):
        sample_tokens(logits, b.temperatures, b.greedy, b.top_ks, b.top_ps, b.min_ps, b.seeds, b.steps)


def test_sampler_kernel_path_applies_penalties_and_bans_first(device):
    # What the engine runs on a GPU: sample(..., use_kernel=True) penalizes in torch, then draws
    # in the kernel; the tokens are the torch sampler's.
    params = [
        SamplingParams(temperature=0.9, repetition_penalty=1.5),
        SamplingParams(temperature=1.0, frequency_penalty=0.7, presence_penalty=0.3, top_p=0.9),
        SamplingParams(temperature=0.8, min_new_tokens=100, top_k=20),
        SamplingParams(temperature=0),
    ]
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(len(params), VOCAB, generator=gen).to(device)
    outputs = [[5, 9, 9], [2, 5, 5, 5], [7], [1]]
    batch = SamplingBatch.build(params, [1, 2, 3, 4], outputs, [[1, 3]] * 4, [2], VOCAB, device)
    want = sample(logits.clone(), batch)
    assert sample(logits.clone(), batch, use_kernel=True).tolist() == want.tolist()


def test_per_filter_set_each_row_draws_what_it_draws_alone(device):
    # Deterministic inference: every row runs its own filters' passes, so a row's token does
    # not depend on what else is in the batch, or where; and it is the sampler's token.
    gen = torch.Generator().manual_seed(4)
    seeds = [11, 2**64 - 3, 7, 123456789, 0, 5, 99, 2**40 + 1, 17, 3]
    logits = torch.randn(len(ROWS), VOCAB, generator=gen).mul(2).to(device)
    batch = _batch(ROWS, seeds, list(range(len(ROWS))), device, per_filter_set=True)
    assert len(set(batch.filter_sets.tolist())) > 4  # a mix of filter sets, and no filter
    got = sample(logits.clone(), batch)
    assert got.tolist() == sample(logits.clone(), batch).tolist()
    for i in range(len(ROWS)):
        alone = sample(logits[i : i + 1].clone(), _batch([ROWS[i]], [seeds[i]], [i], device, True))
        assert alone.tolist() == [got[i].item()], ROWS[i]
    order = list(reversed(range(len(ROWS))))
    flipped = _batch([ROWS[i] for i in order], [seeds[i] for i in order], order, device, True)
    assert sample(logits[order].clone(), flipped).tolist() == got[order].tolist()
