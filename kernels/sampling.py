"""Top-k / top-p / min-p sampling in one kernel, with no host sync and no sort.

Same semantics and the same noise as `rollout.engine.sampler.sample` (after its penalties):
x = logits / T; keep the top_k largest x (ties at the cut kept); of those, keep the most
likely tokens until their mass reaches top_p; drop x < max(x) + log(min_p); take the argmax
of x + Gumbel noise hashed from (seed, step, token id). Greedy rows take argmax(logits).

Without filters (temperature only: the usual RL rollout) a row is cut into chunks, one program
each, and a second kernel takes the best of the chunks' Gumbel-max winners: the same token,
with the whole GPU busy even for one row. With filters one program samples one row. Each cut
is the largest threshold t that still keeps enough
(count of x >= t >= top_k; mass of x >= t >= top_p * total), found by a radix search over
the float32 keys, 4 bits per pass over the row: 8 passes per cut, each comparing every x
against 16 candidate thresholds at once. The top-k cut is exact; the top-p cut sums the
mass in another order than torch's sorted cumsum, so it can differ when top_p falls within
float rounding of a cumulative mass, which moves a token only if it is the one drawn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The sampler's splitmix64 constants; constexpr so that kernels may read them.
GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
MIX2 = tl.constexpr(0x94D049BB133111EB)


@triton.jit
def _mix64(z, ROUNDS: tl.constexpr):
    # splitmix64's finalizer on uint64 (>> is logical there); the sampler's _mix64_.
    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    if ROUNDS == 3:
        z = z ^ (z >> 31)
    return z


@triton.jit
def _row_key(seed_ptr, step_ptr, row):
    """A row's hash key from its seed and step, as the sampler's gumbel_noise makes it."""
    seed = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)
    step = tl.load(step_ptr + row).to(tl.uint64, bitcast=True)
    return _mix64(_mix64(seed + GOLDEN, 3) ^ step, 3)


@triton.jit
def _running_argmax(score, offs, best, best_idx, VOCAB: tl.constexpr):
    """(best, best_idx) after one more block of scores at token ids `offs`. Strictly greater:
    the first index wins ties, as in torch.argmax."""
    block_max = tl.max(score, axis=0)
    block_idx = tl.min(tl.where(score == block_max, offs, VOCAB), axis=0).to(tl.int64)
    return tl.maximum(best, block_max), tl.where(block_max > best, block_idx, best_idx)


@triton.jit
def _gumbel(hash_key, offs):
    """The sampler's Gumbel noise of token ids `offs` for a row's hash key (gumbel_noise)."""
    bits = _mix64(hash_key + (offs.to(tl.uint64) + 1) * GOLDEN, 2)
    # The top 23 bits as the sampler's signed shift sees them, shifted to [0, 2^23).
    top = ((bits >> 41) ^ (1 << 22)).to(tl.float32)
    u = (top + 0.5) * (2.0**-23)  # exact, never 0 or 1
    return -tl.log(-tl.log(u))


@triton.jit
def _order_key(x):
    """float32 -> int64 in [0, 2^32), ordered as the floats are (-0.0 taken as +0.0)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits.to(tl.int64) + 2**31, (~bits).to(tl.int64))


@triton.jit
def _load_scaled(row_ptr, offs, temperature, VOCAB: tl.constexpr):
    valid = offs < VOCAB
    x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    # Rounded division, as torch divides: the top-k cut compares these values exactly.
    return tl.math.div_rn(x, temperature), valid


@triton.jit
def _radix_cut(row_ptr, temperature, limit, m, cut_k,
               MASS: tl.constexpr, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    """Largest key t with weight(x >= t) >= target. Without MASS: weight = count and
    target = limit (top_k). With MASS: weight = exp(x - m) over keys >= cut_k and target =
    limit (top_p) * that total."""
    digits = tl.arange(0, 16).to(tl.int64)
    prefix = tl.full([], 0, tl.int64)
    target = tl.full([], 0.0, tl.float32) + limit
    for r in range(8):  # 4 bits of the 32-bit key per pass, highest first
        shift = 28 - 4 * r
        cand = prefix + (digits << shift)  # [16], ascending
        total = tl.zeros((16,), tl.float32)
        for start in range(0, VOCAB, BLOCK):
            x, valid = _load_scaled(row_ptr, start + tl.arange(0, BLOCK), temperature, VOCAB)
            key = _order_key(x)
            if MASS:
                w = tl.where(valid & (key >= cut_k), tl.exp(x - m), 0.0)
            else:
                w = valid.to(tl.float32)
            total += tl.sum(tl.where(key[:, None] >= cand[None, :], w[:, None], 0.0), axis=0)
        if MASS:
            # Round 0's first candidate is key 0, below every key: its mass is the total.
            total_mass = tl.max(tl.where(digits == 0, total, 0.0), axis=0)
            target = tl.where(r == 0, limit * total_mass, target)
        # total falls as the candidate rises; candidate 0 (the current prefix) always qualifies.
        chosen = tl.maximum(tl.sum((total >= target).to(tl.int64), axis=0) - 1, 0)
        prefix = prefix + (chosen << shift)
    return prefix


@triton.jit
def _sample_kernel(
    logits_ptr, stride_l, temp_ptr, greedy_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    seed_ptr, step_ptr, out_ptr,
    VOCAB: tl.constexpr, BLOCK: tl.constexpr,
    USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, USE_MIN_P: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_l
    is_greedy = tl.load(greedy_ptr + row) != 0
    temperature = tl.where(is_greedy, 1.0, tl.load(temp_ptr + row).to(tl.float32))

    # Pass 1: the max of x (the argmax too, which is the answer for greedy rows).
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, VOCAB, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, valid = _load_scaled(row_ptr, offs, temperature, VOCAB)
        best, best_idx = _running_argmax(x, offs, best, best_idx, VOCAB)
    if is_greedy:
        tl.store(out_ptr + row, best_idx)
        return

    cut_k = tl.full([], 0, tl.int64)  # every key is >= 0: keeps all
    if USE_TOP_K:
        top_k = tl.load(top_k_ptr + row)
        if top_k < VOCAB:
            cut_k = _radix_cut(row_ptr, temperature, top_k.to(tl.float32), best, cut_k,
                               False, VOCAB, BLOCK)
    cut_p = tl.full([], 0, tl.int64)
    if USE_TOP_P:
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            cut_p = _radix_cut(row_ptr, temperature, top_p, best, cut_k, True, VOCAB, BLOCK)
            # The top token always stays, as in the sampler: a top_p of 0 (or one whose target
            # mass flushes to 0) would otherwise cut above every key and keep nothing.
            cut_p = tl.minimum(cut_p, _order_key(best))
    floor = tl.full([], float("-inf"), tl.float32)
    if USE_MIN_P:
        # prob < min_p * max_prob  <=>  x < max(x) + log(min_p); min_p = 0 keeps all.
        min_p = tl.load(min_p_ptr + row)
        floor = tl.where(min_p > 0, best + tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))

    hash_key = _row_key(seed_ptr, step_ptr, row)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, VOCAB, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, valid = _load_scaled(row_ptr, offs, temperature, VOCAB)
        key = _order_key(x)
        keep = valid & (key >= cut_k) & (key >= cut_p) & (x >= floor)
        score = tl.where(keep, x + _gumbel(hash_key, offs), float("-inf"))
        best, best_idx = _running_argmax(score, offs, best, best_idx, VOCAB)
    tl.store(out_ptr + row, best_idx)


@triton.jit
def _draw_chunk_kernel(
    logits_ptr, stride_l, temp_ptr, greedy_ptr, seed_ptr, step_ptr, best_ptr, best_idx_ptr,
    NUM_CHUNKS: tl.constexpr, VOCAB: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    # Program (row, chunk): the argmax over the chunk of x + noise (of x on a greedy row).
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_l
    is_greedy = tl.load(greedy_ptr + row) != 0
    temperature = tl.where(is_greedy, 1.0, tl.load(temp_ptr + row).to(tl.float32))
    hash_key = _row_key(seed_ptr, step_ptr, row)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    first = chunk * CHUNK
    for start in range(first, first + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, valid = _load_scaled(row_ptr, offs, temperature, VOCAB)
        noisy = tl.where(valid, x + _gumbel(hash_key, offs), float("-inf"))
        score = tl.where(is_greedy, x, noisy)
        best, best_idx = _running_argmax(score, offs, best, best_idx, VOCAB)
    tl.store(best_ptr + row * NUM_CHUNKS + chunk, best)
    tl.store(best_idx_ptr + row * NUM_CHUNKS + chunk, best_idx)


@triton.jit
def _pick_chunk_kernel(best_ptr, best_idx_ptr, out_ptr,
                       NUM_CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr, VOCAB: tl.constexpr):
    # The row's winner: the highest chunk score, the lowest token id among equal ones (the
    # first maximum, as one pass over the row finds it).
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    mask = c < NUM_CHUNKS
    vals = tl.load(best_ptr + row * NUM_CHUNKS + c, mask=mask, other=float("-inf"))
    idxs = tl.load(best_idx_ptr + row * NUM_CHUNKS + c, mask=mask, other=VOCAB)
    top = tl.max(vals, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(mask & (vals == top), idxs, VOCAB), axis=0))


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    greedy: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    use_top_k: bool = True,
    use_top_p: bool = True,
    use_min_p: bool = True,
    block: int = 1024,
    chunk: int = 8192,
) -> torch.Tensor:
    """logits: [B, V] (penalties already applied), last dim contiguous. Per row, as in
    SamplingBatch: temperatures [B] or [B, 1] (> 0 where not greedy: SamplingBatch makes
    temperatures too small for float32 greedy); greedy [B] bool; top_ks [B] int64 (>= V: off);
    top_ps, min_ps [B] float32 (1 and 0: off); seeds, steps [B] int64. The use_* flags are
    host-known promises that no row needs that filter (False skips its passes); with none,
    each row is drawn in chunks of `chunk` tokens by programs of their own. Returns [B] int64
    token ids; never reads a value back to the host."""
    b, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("sample_tokens needs logits with a contiguous last dim")
    per_row = {"greedy": greedy, "top_ks": top_ks, "top_ps": top_ps, "min_ps": min_ps,
               "seeds": seeds, "steps": steps, "temperatures": temperatures.reshape(-1)}
    for name, tensor in per_row.items():
        if tensor.shape != (b,):
            raise ValueError(f"sample_tokens needs {name} with one value per row ({b}), got {tuple(tensor.shape)}")
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    block = min(block, triton.next_power_of_2(vocab))
    if not (use_top_k or use_top_p or use_min_p):
        chunk = triton.cdiv(max(chunk, block), block) * block  # whole blocks per chunk
        chunks = triton.cdiv(vocab, chunk)
        best = torch.empty((b, chunks), dtype=torch.float32, device=logits.device)
        best_idx = torch.empty((b, chunks), dtype=torch.int64, device=logits.device)
        _draw_chunk_kernel[(b, chunks)](
            logits, logits.stride(0), per_row["temperatures"], greedy.to(torch.int8), seeds,
            steps, best, best_idx,
            NUM_CHUNKS=chunks, VOCAB=vocab, CHUNK=chunk, BLOCK=block, num_warps=4,
        )
        _pick_chunk_kernel[(b,)](
            best, best_idx, out, NUM_CHUNKS=chunks, BLOCK_C=triton.next_power_of_2(chunks), VOCAB=vocab
        )
        return out
    _sample_kernel[(b,)](
        logits, logits.stride(0), per_row["temperatures"], greedy.to(torch.int8), top_ks,
        top_ps, min_ps, seeds, steps, out,
        VOCAB=vocab, BLOCK=block,
        USE_TOP_K=use_top_k, USE_TOP_P=use_top_p, USE_MIN_P=use_min_p,
        num_warps=8,
    )
    return out
