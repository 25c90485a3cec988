"""The LoRA shrink and expand kernels against torch, on batches that mix base-only rows with
rows of three adapters of different ranks (and an empty slot), with given launch settings and
with the engine's for each batch size; the layer's kernel path against its torch path; on a
GPU, a CUDA graph replaying other mixes of adapters.

bfloat16 runs on a GPU only: Triton's interpreter multiplies bfloat16 tiles wrongly (tl.dot)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rollout.models.lora_layer import LoraBatch, LoraLayer  # noqa: E402
from rollout_kernels.lora_expand import (  # noqa: E402
    RANK_ALIGN,
    OutputParts,
    lora_expand,
    lora_expand_reference,
)
from rollout_kernels.lora_segments import LONG_ROWS, lora_segments  # noqa: E402
from rollout_kernels.lora_shrink import (  # noqa: E402
    DECODE_ROWS,
    lora_shrink,
    lora_shrink_reference,
    shrink_settings,
)

DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])
RANKS = [8, 16, 4, 0]  # slots 0..2 hold adapters of these ranks; slot 3 is empty
R = 16  # max rank
K = 96  # input features: not a multiple of the K tile


def tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


def mixed_slots(t: int, seed: int) -> torch.Tensor:
    """Rows of adapters 0, 1, 2 and base-only rows (-1, and 9: outside the slots) shuffled."""
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor([-1, 0, 1, 2, 9])[torch.randint(0, 5, (t,), generator=gen)]


def random_weights(parts: int, out: int, dtype, device, seed: int = 0):
    """A [S, parts x R, K] and B [S, out, R] with garbage past each slot's rank (for B, past
    its rank rounded up to RANK_ALIGN, which the expand reads and LoraLayer keeps zero): the
    kernels must not read it (the references mask it)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(len(RANKS), parts * R, K, generator=gen) / K**0.5
    b = torch.randn(len(RANKS), out, R, generator=gen) / R**0.5
    return a.to(device, dtype), zero_past_rank(b, RANKS).to(device, dtype)


def zero_past_rank(b: torch.Tensor, ranks) -> torch.Tensor:
    """B [S, N, R] with each slot's columns from its rank up to the next multiple of
    RANK_ALIGN zeroed, as LoraLayer's slots hold them (and all past the rank)."""
    b = b.clone()
    for s, rank in enumerate(ranks):
        b[s, :, rank : -(-rank // RANK_ALIGN) * RANK_ALIGN] = 0
    return b


def test_segments_group_each_slots_rows_in_order(device):
    slots = mixed_slots(50, seed=0).to(device)
    seg = lora_segments(slots, num_slots=4, block_m=16)
    order = seg.order.tolist()
    blocks = 0
    for s in range(4):
        start, length = seg.seg_start[s].item(), seg.seg_len[s].item()
        assert order[start : start + length] == (slots == s).nonzero().flatten().tolist()
        blocks += -(-length // 16)
        assert seg.block_end[s].item() == blocks
    assert seg.grid_blocks() >= blocks
    base = [i for i, s in enumerate(slots.tolist()) if s not in (0, 1, 2, 3)]
    assert order[len(order) - len(base) :] == base  # base-only rows last, in order


def test_each_blocks_table_entry_names_rows_of_its_slot_and_covers_them_once(device):
    slots = mixed_slots(70, seed=4).to(device)
    seg = lora_segments(slots, num_slots=4, block_m=16)
    order = seg.order.tolist()
    seen: dict[int, list[int]] = {s: [] for s in range(4)}
    for b in range(seg.grid_blocks()):
        slot, first, rows = (t[b].item() for t in (seg.block_slot, seg.block_first, seg.block_rows))
        assert 0 <= rows <= 16
        if rows == 0:
            continue
        assert slot < 4
        seen[slot] += order[first : first + rows]
    for s in range(4):
        assert sorted(seen[s]) == (slots == s).nonzero().flatten().tolist()
    assert seg.block_rows[seg.block_end[-1].item() :].eq(0).all()  # past the last slot: empty


def test_the_grid_covers_every_slots_blocks_and_no_more_than_its_rows_need(device):
    # The grid is fixed by the rows and slots alone (a CUDA graph replays it): it must cover
    # the worst layout of those rows over the slots, and a decode row must not pay for the
    # slots it does not use.
    gen = torch.Generator().manual_seed(0)
    for t, s in [(1, 9), (2, 2), (17, 2), (33, 2), (31, 16), (64, 9), (100, 3)]:
        worst = 0
        for _ in range(30):
            # Rows spread so that as many slots as possible end just past a block boundary.
            slots = torch.randint(0, s, (t,), generator=gen)
            if t >= s:
                slots[: s * (t // s)] = torch.arange(s).repeat_interleave(t // s)
            seg = lora_segments(slots.to(device), num_slots=s, block_m=16)
            worst = max(worst, seg.block_end[-1].item())
            assert worst <= seg.grid_blocks()
        assert seg.grid_blocks() == -(-t // 16) + min(s, t) - 1
    # A long prefill's blocks are of 64 rows, with the same cover.
    slots = torch.arange(LONG_ROWS + 5, device=device) % 3
    seg = lora_segments(slots, num_slots=3)
    assert seg.block_m == 64 and seg.block_end.tolist() == [6, 12, 18]
    assert seg.grid_blocks() == -(-(LONG_ROWS + 5) // 64) + 2
    assert lora_segments(torch.zeros(1, dtype=torch.long, device=device), 9).grid_blocks() == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "split_k"), [(1, 2), (5, None), (40, 1), (40, 3)])
def test_shrink_matches_torch(device, dtype, rows, split_k):
    slots = mixed_slots(rows, seed=rows).to(device)
    slots[0] = 1  # at least one adapter row
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=device)
    a, _ = random_weights(3, 8, dtype, device)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    y = lora_shrink(x, a, lora_segments(slots, 4), ranks, rank_stride=R, split_k=split_k)
    want = lora_shrink_reference(x, a, slots, ranks, R)
    used = (slots >= 0) & (slots < 4)
    assert y.dtype == torch.float32 and y.shape[1:] == (rows, 3 * R)
    torch.testing.assert_close(y.sum(0)[used], want[used], **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("sizes", "splits"), [((40,), 2), ((64, 16, 16), 6), ((24, 72), 9)])
def test_expand_matches_torch_for_one_projection_or_a_group(device, dtype, sizes, splits):
    # The shrink's partials (splits of them) are summed a chunk at a time, the last one partial.
    rows, p, n = 37, len(sizes), sum(sizes)
    slots = mixed_slots(rows, seed=p).to(device)
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(2)
    _, b = random_weights(p, n, dtype, device)
    y = torch.randn(splits, rows, p * R, generator=gen).to(device)  # split-K partials
    scales = torch.rand(len(RANKS), p, generator=gen).to(device)
    out = torch.randn(rows, n, generator=gen).to(device, dtype)
    want = lora_expand_reference(y.sum(0), b, out, slots, scales, sizes, ranks)
    got = lora_expand(
        y, b, out.clone(), lora_segments(slots, 4), ranks, scales, OutputParts.make(sizes, device)
    )
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))
    base = (slots < 0) | (slots >= 4)
    assert torch.equal(got[base], out[base])  # base-only rows untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tiles, num_stages", [(2, None), (3, 2)])
def test_expand_walking_several_column_tiles_per_program_matches_torch(
    device, dtype, n_tiles, num_stages
):
    # Parts of 40 and 24 columns in tiles of 16: a program's last tiles fall past its part.
    rows, sizes = 21, (40, 24)
    p, n = len(sizes), sum(sizes)
    slots = mixed_slots(rows, seed=11).to(device)
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(12)
    _, b = random_weights(p, n, dtype, device, seed=3)
    y = torch.randn(3, rows, p * R, generator=gen).to(device)
    scales = torch.rand(len(RANKS), p, generator=gen).to(device)
    out = torch.randn(rows, n, generator=gen).to(device, dtype)
    want = lora_expand_reference(y.sum(0), b, out, slots, scales, sizes, ranks)
    got = lora_expand(
        y, b, out.clone(), lora_segments(slots, 4), ranks, scales, OutputParts.make(sizes, device),
        block_n=16, n_tiles=n_tiles, num_stages=num_stages,
    )  # fmt: skip
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))
    base = (slots < 0) | (slots >= 4)
    assert torch.equal(got[base], out[base])
    with pytest.raises(ValueError, match="n_tiles >= 1, got 0"):
        lora_expand(
            y, b, out.clone(), lora_segments(slots, 4), ranks, scales,
            OutputParts.make(sizes, device), n_tiles=0,
        )  # fmt: skip


@pytest.mark.parametrize(("n_tiles", "splits"), [(1, 2), (2, 5)])
def test_expand_with_ranks_past_one_rank_block_matches_torch(device, n_tiles, splits):
    # A max rank of 80 reads y and B in rank blocks of 64: the adapter of rank 72 needs two.
    rows, sizes, max_rank = 19, (24, 24), 80
    p, n = len(sizes), sum(sizes)
    slots = mixed_slots(rows, seed=13).to(device)
    ranks = torch.tensor([72, 16, 64, 0], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(14)
    b = zero_past_rank(torch.randn(4, n, max_rank, generator=gen) / max_rank**0.5, [72, 16, 64, 0])
    b = b.to(device)
    y = torch.randn(splits, rows, p * max_rank, generator=gen).to(device)
    scales = torch.rand(4, p, generator=gen).to(device)
    out = torch.randn(rows, n, generator=gen).to(device)
    want = lora_expand_reference(y.sum(0), b, out, slots, scales, sizes, ranks)
    got = lora_expand(
        y, b, out.clone(), lora_segments(slots, 4), ranks, scales, OutputParts.make(sizes, device),
        block_n=16, n_tiles=n_tiles,
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, DECODE_ROWS, DECODE_ROWS + 1, 64, 300, LONG_ROWS + 37])
def test_the_engines_settings_for_each_batch_size_match_torch(device, dtype, rows):
    # The kernels' defaults: the launch the engine makes for this many rows, either side of
    # the decode batch's bound, for a prefill and for a long prefill (blocks of 64 rows).
    # K is long enough that every size up to a long prefill splits it.
    k, sizes = 640, (48, 16, 16)
    p, n = len(sizes), sum(sizes)
    slots = mixed_slots(rows, seed=rows).to(device)
    slots[0] = 1  # at least one adapter row
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(8)
    a = (torch.randn(len(RANKS), p * R, k, generator=gen) / k**0.5).to(device, dtype)
    b = zero_past_rank(torch.randn(len(RANKS), n, R, generator=gen) / R**0.5, RANKS)
    b = b.to(device, dtype)
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    scales = torch.rand(len(RANKS), p, generator=gen).to(device)
    out = torch.randn(rows, n, generator=gen).to(device, dtype)
    segments = lora_segments(slots, len(RANKS))
    assert segments.block_m == (64 if rows > LONG_ROWS else 16)
    y = lora_shrink(x, a, segments, ranks, rank_stride=R)
    assert y.shape[0] > 1 or rows > LONG_ROWS
    cap = shrink_settings(rows).max_split_k
    if cap is not None:  # past a decode batch the partials stay few
        assert y.shape[0] <= cap
    want_y = lora_shrink_reference(x, a, slots, ranks, R)
    used = (slots >= 0) & (slots < len(RANKS))
    torch.testing.assert_close(y.sum(0)[used], want_y[used], **tol(dtype))
    got = lora_expand(y, b, out.clone(), segments, ranks, scales, OutputParts.make(sizes, device))
    want = lora_expand_reference(want_y, b, out, slots, scales, sizes, ranks)
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))


def lora_layers(sizes: dict[str, int], in_features: int, dtype, device, max_tokens: int = 64):
    """Two LoraLayers with the same three adapters: one on the kernels, one on torch ops."""
    gen = torch.Generator().manual_seed(3)
    weights = {
        part: [
            (torch.randn(r, in_features, generator=gen), torch.randn(size, r, generator=gen))
            for r in RANKS[:3]
        ]
        for part, size in sizes.items()
    }
    layers = []
    for use_kernels in (True, False):
        batch = LoraBatch(len(RANKS), max_tokens, device, use_kernels)
        batch.ranks.copy_(torch.tensor(RANKS))
        batch.live_slots = (0, 1, 2)
        layer = LoraLayer(sizes, in_features, R, batch, dtype, device)
        for part, per_slot in weights.items():
            for slot, (a, b) in enumerate(per_slot):
                layer.write(slot, part, a / in_features**0.5, b / 4, scale=0.5 + slot)
        layers.append(layer)
    return layers


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [3, 70])  # within the batch buffers, and beyond them
def test_the_layers_kernel_path_matches_its_torch_path(device, dtype, rows):
    fast, ref = lora_layers({"q_proj": 48, "k_proj": 16, "v_proj": 16}, K, dtype, device)
    slots = mixed_slots(rows, seed=4)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    out = torch.randn(rows, 80, generator=torch.Generator().manual_seed(6)).to(device, dtype)
    got, want = out.clone(), out.clone()
    for layer, result in ((fast, got), (ref, want)):
        layer.batch.prepare(slots.to(device))
        layer.apply(x, result)
    assert not torch.equal(got, out)
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))
    fast.batch.prepare(slots.to(device), active=False)  # no adapter row: nothing added
    assert torch.equal(fast.apply(x, out.clone()), out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layer_beside_its_gemm_adds_what_it_adds_after_it(device, dtype):
    """LoraLayer.around for a batch of up to beside_rows rows (on a second stream on a GPU):
    a layer that adds its delta itself gives apply's output; one that defers returns the base
    output and leaves a float32 delta that, added and rounded, gives the same; past
    beside_rows, or with no adapter row, nothing is left."""
    sizes = {"gate_proj": 40, "up_proj": 40}
    fast, _ = lora_layers(sizes, K, dtype, device)
    rows = 6
    slots = mixed_slots(rows, seed=8)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(rows, K, generator=gen).to(device, dtype)
    base = torch.randn(rows, 80, generator=gen).to(device, dtype)
    fast.batch.prepare(slots.to(device))
    want = fast.apply(x, base.clone())
    fast.batch.run_beside(rows)
    assert (fast.batch.side_stream is not None) == (device == "cuda")
    exact = device == "cpu"  # a GPU may fuse the expand's multiply and add (one rounding)

    def same(got: torch.Tensor) -> None:
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, **tol(dtype))

    same(fast.around(x, base.clone))
    assert fast.take_delta() is None
    fast.defers = True
    got = fast.around(x, base.clone)
    assert torch.equal(got, base)  # the base output, its delta left for the next kernel
    delta = fast.take_delta()
    assert delta.dtype == torch.float32 and delta.shape == (rows, 80)
    same((got.float() + delta).to(dtype))
    assert fast.take_delta() is None  # given once
    base_rows = slots.lt(0) | slots.ge(3)  # base-only rows, and the empty slot's: no delta
    assert torch.equal(delta[base_rows.to(device)], torch.zeros_like(delta[base_rows.to(device)]))
    fast.batch.run_beside(rows - 1)  # past the bound: added after the GEMM, nothing left
    same(fast.around(x, base.clone))
    assert fast.take_delta() is None
    fast.batch.run_beside(rows)
    fast.batch.prepare(slots.to(device), active=False)
    assert torch.equal(fast.around(x, base.clone), base) and fast.take_delta() is None


def test_kernel_inputs_are_checked(device):
    x = torch.zeros(4, K, device=device)
    a, b = random_weights(1, 8, torch.float32, device)
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=device)
    seg = lora_segments(torch.zeros(4, dtype=torch.int32, device=device), 4)
    with pytest.raises(ValueError, match="lora_shrink needs x \\[T, K\\]"):
        lora_shrink(x[:, :-1], a, seg, ranks)
    with pytest.raises(ValueError, match="segments are of 4 rows, x has 3"):
        lora_shrink(x[:3], a, seg, ranks)
    y = lora_shrink(x, a, seg, ranks)
    scales = torch.ones(4, 1, device=device)
    with pytest.raises(ValueError, match="lora_expand needs y"):
        lora_expand(
            y,
            b,
            torch.zeros(4, 9, device=device),
            seg,
            ranks,
            scales,
            OutputParts.make([9], device),
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_graph_replays_any_mix_of_adapters():
    fast, ref = lora_layers({"gate_proj": 64, "up_proj": 64}, K, torch.bfloat16, "cuda")
    rows = 24
    x = torch.zeros(rows, K, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(rows, 128, dtype=torch.bfloat16, device="cuda")
    fast.batch.prepare(torch.full((rows,), -1, device="cuda"))
    fast.apply(x, out)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fast.apply(x, out)
    gen = torch.Generator().manual_seed(7)
    for seed in range(3):
        slots = mixed_slots(rows, seed=10 + seed)
        x.copy_(torch.randn(rows, K, generator=gen))
        out.zero_()
        fast.batch.prepare(slots.cuda())  # rewrites the buffers the graph reads
        graph.replay()
        ref.batch.prepare(slots.cuda())
        want = ref.apply(x, torch.zeros_like(out))
        torch.testing.assert_close(out.float(), want.float(), **tol(torch.bfloat16))
