"""SamplingParams validation and the batched sampler: filters, penalties, bans, seeding."""

from __future__ import annotations

import pytest
import torch
from devices import CPU_AND_CUDA

from rollout.engine.sampler import (
    SamplingBatch,
    _gumbel_from_top_bits,
    _mix64_,
    apply_penalties_and_masks,
    gumbel_noise,
    sample,
)
from rollout.engine.sampling_params import SamplingParams as SP

DEVICES = CPU_AND_CUDA
EOS = 5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": -1}, "max_new_tokens must be >= 0, got -1"),
        ({"max_new_tokens": 1.5}, "max_new_tokens must be an int, got 1.5"),
        ({"max_new_tokens": "8"}, "max_new_tokens must be an int, got '8'"),
        ({"min_new_tokens": -2}, "min_new_tokens must be >= 0, got -2"),
        ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens must be <= max_new_tokens"),
        ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"temperature": float("nan")}, "temperature must be >= 0, got nan"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_k": 0}, "top_k must be -1 (off) or >= 1, got 0"),
        ({"top_k": True}, "top_k must be an int, got True"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0.0"),
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2], got 2.5"),
        ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3.0"),
        ({"stop": ["ok", ""]}, "stop must be a non-empty string"),
        ({"stop": 7}, "stop must be a non-empty string"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids must be a list of ints >= 0"),
        ({"stop_token_ids": [True]}, "stop_token_ids must be a list of ints >= 0"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens must be a bool"),
        ({"spaces_between_special_tokens": None}, "spaces_between_special_tokens must be a bool"),
        ({"no_stop_trim": 0}, "no_stop_trim must be a bool"),
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"seed": "1"}, "seed must be an int, got '1'"),
    ],
)
def test_invalid_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as err:
        SP(**kwargs)
    assert message in str(err.value)


def test_normalization_and_dict_round_trip():
    p = SP(stop="###", stop_token_ids=(3, 4), temperature=1, seed=-7)
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4] and p.temperature == 1.0
    assert SP().stop == [] and SP().stop_token_ids == []
    assert SP.from_dict(p.to_dict()) == p
    assert SP.from_dict(None) == SP()
    assert SP(temperature=0).is_greedy and SP(top_k=1).is_greedy and not SP().is_greedy


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(
        ValueError, match="unknown sampling parameter.*'max_tokens'.*max_new_tokens"
    ):
        SP.from_dict({"max_tokens": 3, "top_p": 0.5})


def make_batch(params, seeds=None, outputs=None, prompts=None, vocab=10, device="cpu"):
    n = len(params)
    return SamplingBatch.build(
        params,
        seeds if seeds is not None else list(range(n)),
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[0] for _ in range(n)],
        [EOS],
        vocab,
        device,
    )


def draw(logits, params, **kw):
    return sample(logits.clone(), make_batch(params, vocab=logits.shape[-1], **kw))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "params", [SP(temperature=0), SP(top_k=1, temperature=2.0), SP(top_p=1e-6, temperature=1.5)]
)
def test_greedy_like_params_take_the_argmax(device, params):
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)).to(device)
    # One sampling row in the batch so that the non-greedy path runs too.
    mixed = [params] * 63 + [SP(temperature=1.0)]
    tokens = draw(logits, mixed, device=device)
    assert torch.equal(tokens[:63], logits[:63].argmax(-1))


def test_top_k_min_p_top_p_restrict_the_support():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(2000, 4)
    seeds = list(range(2000))
    support = [
        (SP(top_k=2), {0, 1}),
        (SP(min_p=0.2), {0, 1, 2}),  # drops prob < 0.1
        (SP(min_p=0.5), {0, 1}),  # drops prob < 0.25
        (SP(top_p=0.7), {0, 1}),  # mass before token 2 is 0.8 >= 0.7
        (SP(top_p=0.85), {0, 1, 2}),
        (SP(), {0, 1, 2, 3}),
    ]
    for params, expected in support:
        got = set(draw(logits, [params] * 2000, seeds=seeds).tolist())
        assert got == expected, params


def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]] * 2)
    penalized = SP(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    batch = make_batch([penalized, SP()], outputs=[[2, 2, 3]] * 2, prompts=[[0, 1]] * 2, vocab=6)
    out = apply_penalties_and_masks(logits.clone(), batch)
    # token 0, 1: prompt only -> repetition; 2 (x2), 3: output -> repetition, then f * count + p
    expected = [1.0, -2.0, 0.25 - 1.0 - 0.25, 1.5 - 0.5 - 0.25, -2.0, 0.0]
    torch.testing.assert_close(out[0], torch.tensor(expected))
    assert torch.equal(out[1], logits[1])


@pytest.mark.parametrize("device", DEVICES)
def test_min_new_tokens_bans_eos_and_stop_ids(device):
    logits = torch.zeros(3, 10)
    logits[:, EOS], logits[:, 3], logits[:, 7] = 10.0, 9.0, 8.0
    logits = logits.to(device)
    params = [
        SP(temperature=0, min_new_tokens=3, stop_token_ids=[3]),
        SP(temperature=0, min_new_tokens=3, stop_token_ids=[3], ignore_eos=True),
        SP(temperature=0, min_new_tokens=3, stop_token_ids=[3]),
    ]
    tokens = draw(logits, params, outputs=[[1], [1, 2], [1, 2, 4]], device=device)
    assert tokens.tolist() == [7, 7, EOS]  # the third row has its 3 tokens: nothing banned


@pytest.mark.parametrize("device", DEVICES)
def test_token_depends_only_on_own_seed_step_and_logits(device):
    gen = torch.Generator().manual_seed(1)
    mine, my_logits = SP(temperature=0.8, top_p=0.95), torch.randn(1, 2000, generator=gen)
    others = [SP(temperature=0), SP(top_k=5, repetition_penalty=1.3), SP(min_p=0.1), SP(n=2)]
    other_logits = torch.randn(4, 2000, generator=gen)
    for seed in range(40):
        step = [9] * (seed % 7)  # outputs so far, so the step varies too
        alone = draw(my_logits.to(device), [mine], seeds=[seed], outputs=[step], device=device)
        crowd = draw(
            torch.cat([other_logits[:2], my_logits, other_logits[2:]]).to(device),
            others[:2] + [mine] + others[2:],
            seeds=[seed + 1, seed, seed, 123, 5],
            outputs=[[1, 2], [3], step, [], step],
            device=device,
        )
        assert alone.item() == crowd[2].item()


def test_different_seeds_and_steps_differ():
    logits = torch.zeros(200, 1000)
    by_seed = draw(logits, [SP()] * 200, seeds=list(range(200)))
    by_step = draw(logits, [SP()] * 200, seeds=[7] * 200, outputs=[[0] * i for i in range(200)])
    assert len(set(by_seed.tolist())) > 150 and len(set(by_step.tolist())) > 150


@pytest.mark.parametrize(
    "params, vary",
    [(SP(), "seed"), (SP(temperature=0.6), "step"), (SP(temperature=1.3, top_k=6), "seed")],
)
def test_sampled_frequencies_match_softmax(params, vary):
    n, vocab = 20_000, 10
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2))
    expected = torch.softmax(logits / params.temperature, -1)
    if params.top_k > 0:
        expected[expected < expected.topk(params.top_k).values[-1]] = 0
        expected /= expected.sum()
    if vary == "seed":
        kw = {"seeds": list(range(n))}
    else:
        # 100 seeds x 200 steps: the step alone must change the draw.
        kw = {"seeds": [i // 200 for i in range(n)], "outputs": [[0] * (i % 200) for i in range(n)]}
    tokens = draw(logits.expand(n, vocab), [params] * n, **kw)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[expected == 0].sum() == 0
    e = expected[expected > 0].double() * n
    chi2 = ((counts[expected > 0] - e) ** 2 / e).sum().item()
    # Deterministic (hashed noise); 99.9% quantile of chi-square with <= 9 dof is 27.9.
    assert chi2 < 27.9, (chi2, counts, e)


def test_noise_is_splitmix64_and_finite_at_the_extremes():
    mask, x = (1 << 64) - 1, 0x0123456789ABCDEF
    z = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & mask
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
    z ^= z >> 31
    assert _mix64_(torch.tensor([x])).item() & mask == z
    extremes = torch.tensor([-(2**63), -1, 0, 2**63 - 1, 2**41 - 1, -(2**41)])
    assert torch.isfinite(_gumbel_from_top_bits(extremes)).all()
    g = gumbel_noise(torch.arange(8), torch.zeros(8, dtype=torch.int64), 50_000)
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.std().item() - 1.2825) < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_noise_is_the_same_on_cuda_and_cpu():
    seeds = torch.tensor([-(2**63), -1, 0, 7, 2**63 - 1])
    steps = torch.tensor([0, 1, 2, 3, 100_000])
    cpu = gumbel_noise(seeds, steps, 152_000)
    cuda = gumbel_noise(seeds.cuda(), steps.cuda(), 152_000).cpu()
    torch.testing.assert_close(cuda, cpu)


@pytest.mark.parametrize("device", DEVICES)
def test_build_holds_each_rows_values(device):
    # Greedy rows at temperature 1, top_k V when off (or above V), seeds mod 2^64 as int64, and
    # (rows, ids) pairs only for the rows that penalize or ban.
    params = [
        SP(temperature=0),
        SP(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1),
        SP(top_k=10**30, repetition_penalty=1.2),
        SP(frequency_penalty=0.5, presence_penalty=-1.0, min_new_tokens=4, stop_token_ids=[7, 12]),
    ]
    batch = make_batch(
        params, seeds=[0, -1, 2**64 + 5, 2**70], outputs=[[1], [], [2, 2], [3, 4]], device=device
    )
    expected = {
        "temperatures": ([[1.0], [0.5], [1.0], [1.0]], torch.float32),
        "greedy": ([True, False, False, False], torch.bool),
        "top_ks": ([10, 3, 10, 10], torch.int64),
        "top_ps": ([1.0, 0.9, 1.0, 1.0], torch.float32),
        "min_ps": ([0.0, 0.1, 0.0, 0.0], torch.float32),
        "seeds": ([0, -1, 5, 0], torch.int64),
        "steps": ([1, 0, 2, 2], torch.int64),
        "repetition_penalties": ([1.0, 1.0, 1.2, 1.0], torch.float32),
        "frequency_penalties": ([[0.0], [0.0], [0.0], [0.5]], torch.float32),
        "presence_penalties": ([[0.0], [0.0], [0.0], [-1.0]], torch.float32),
    }
    for name, (values, dtype) in expected.items():
        got = getattr(batch, name)
        assert got.device.type == device and got.dtype == dtype, name
        assert torch.equal(got.cpu(), torch.tensor(values, dtype=dtype)), name
    pairs = {
        "seen": [[2, 2, 2], [0, 2, 2]],
        "generated": [[3, 3], [3, 4]],
        "banned": [[3, 3], [EOS, 7]],
    }
    for name, (rows, ids) in pairs.items():
        got_rows, got_ids = getattr(batch, name)
        assert got_rows.tolist() == rows and got_ids.tolist() == ids, name
    assert (batch.all_greedy, batch.any_greedy, batch.top_k_max) == (False, True, 3)
    assert batch.use_top_p and batch.use_min_p
    plain = make_batch([SP(), SP(temperature=0.7)], device=device)
    assert plain.seen is None and plain.generated is None and plain.banned is None
    assert (plain.top_k_max, plain.use_top_p, plain.use_min_p) == (0, False, False)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7])
def test_per_row_arrays_start_on_16_byte_boundaries_in_any_batch_size(n):
    # The sampling kernel is a Triton kernel, built once per alignment of its pointer
    # arguments: aligned whatever the batch's size, one build serves every batch.
    params = [SP(temperature=0.7, top_k=3, top_p=0.9, min_p=0.01, repetition_penalty=1.1)] * n
    batch = make_batch(params, seeds=[2**63 + i for i in range(n)], outputs=[[1, 2]] * n)
    per_row = {
        "temperatures": batch.temperatures, "top_ks": batch.top_ks, "top_ps": batch.top_ps,
        "min_ps": batch.min_ps, "seeds": batch.seeds, "steps": batch.steps,
        "repetition_penalties": batch.repetition_penalties,
    }  # fmt: skip
    for name, tensor in per_row.items():
        offset = tensor.data_ptr() - tensor.untyped_storage().data_ptr()
        assert offset % 16 == 0, (name, offset)
        assert tensor.shape[0] == n, name
    assert batch.top_ks.tolist() == [3] * n and batch.steps.tolist() == [2] * n
    assert torch.allclose(batch.top_ps, torch.full((n,), 0.9))
    assert batch.seeds.view(torch.int64).tolist() == [(2**63 + i) - 2**64 for i in range(n)]
