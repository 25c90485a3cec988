"""Batched sampling without host syncs: penalties, min-token bans, temperature, top-k, top-p,
min-p, then Gumbel-max with noise hashed from (seed, step, token id).

A row's token depends only on its own logits, seed and step: never on the other rows of the
batch nor on torch's global RNG. Python branches only on host-known flags of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rollout.engine.filter_sets import row_filter_sets, sample_per_filter_set
from rollout.engine.sampling_params import (
    MIN_PROBABILITY,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    SamplingParams,
)

# Rows are filtered and sampled in chunks of about this many logits, which bounds the
# [rows, V] int64 temporaries (sort indices, hash state) to 128 MiB each.
_CHUNK_ELEMS = 1 << 24
_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """A 64-bit pattern as the signed int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


@dataclass
class SamplingBatch:
    """The tensors of one sampling step for B requests, built on the host by `build`.
    (rows, ids) pairs index the [B, V] logits; None means no request needs that step."""

    temperatures: Tensor  # [B, 1] float32; 1.0 on greedy rows (they take the argmax)
    greedy: Tensor  # [B] bool
    top_ks: Tensor  # [B] int64, V when off
    top_ps: Tensor  # [B] float32
    min_ps: Tensor  # [B] float32
    seeds: Tensor  # [B] int64
    steps: Tensor  # [B] int64, tokens the request has generated so far
    repetition_penalties: Tensor  # [B] float32
    frequency_penalties: Tensor  # [B, 1] float32
    presence_penalties: Tensor  # [B, 1] float32
    seen: tuple[Tensor, Tensor] | None  # [N] rows, [N] ids: prompt+output tokens (repeats ok)
    generated: tuple[Tensor, Tensor] | None  # one pair per output token (repeats count)
    banned: tuple[Tensor, Tensor] | None  # EOS/stop ids while output < min_new_tokens
    all_greedy: bool
    any_greedy: bool
    top_k_max: int  # largest top_k of the rows that use one; 0 if none does
    use_top_p: bool
    use_min_p: bool
    # logit_bias: [N] rows, [N] ids, [N] float32 values added to those logits; None if unused.
    bias: tuple[Tensor, Tensor, Tensor] | None = None
    # [B] on the host: the filters each row uses (filter_sets.py's FILTER_* bits); built only
    # when asked (build's per_filter_set).
    filter_sets: np.ndarray | None = None

    @property
    def filtered(self) -> bool:
        """Does any row cut its distribution (top-k, top-p or min-p)?"""
        return bool(self.top_k_max) or self.use_top_p or self.use_min_p

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        output_ids: list[list[int]],
        prompt_ids: list[list[int]],
        eos_token_ids: list[int],
        vocab_size: int,
        device: torch.device | str,
        steps: list[int] | None = None,
        per_filter_set: bool = False,
    ) -> SamplingBatch:
        """All lists are per request, in row order. Seeds are any Python ints (taken mod 2^64).
        `steps`: tokens each request has generated so far, when output_ids lag behind (they must
        not for a request with penalties); defaults to len(output_ids[i]). `per_filter_set`:
        also note each row's filters (filter_sets): sample then draws per filter set.
        All goes to `device` in one non-blocking copy: building never waits for the device."""
        n, V = len(params), vocab_size
        steps = [len(ids) for ids in output_ids] if steps is None else steps
        values = _float_params(params)  # [6, B]
        temperature, _, _, repetition, frequency, presence = values
        # Which of top_p, min_p and the penalties some row uses (moves from its neutral value).
        used = (values != _NEUTRAL).any(axis=1)
        # top_k may be any int: every one above V is as off as V + 1.
        top_k = np.array([p.top_k if p.top_k <= V else V + 1 for p in params], dtype=np.int64)
        greedy = (temperature < MIN_TEMPERATURE) | (top_k == 1)
        num_greedy = int(np.count_nonzero(greedy))
        top_ks = np.where((top_k > 0) & (top_k < V), top_k, V)
        # Each per-row array starts on a 16-byte boundary whatever the batch's size: Triton
        # builds a kernel variant per alignment of its pointer arguments, so unpadded rows
        # would give the sampling kernel another variant for each batch size mod 4.
        cols = -(-n // 4) * 4
        ints = np.zeros((3, cols), dtype=np.int64)
        ints[0, :n] = top_ks
        ints[1, :n].view(np.uint64)[:] = [s & _MASK64 for s in seeds]
        ints[2, :n] = steps
        floats = np.zeros((6, cols), dtype=np.float32)
        floats[:, :n] = values
        floats[0, :n][greedy] = 1.0
        _to_float32_limits(floats[:, :n])
        host = {"ints": ints, "floats": floats, "greedy": greedy}
        # Penalties and bans are rare: their (rows, ids) pairs are built only when a row has one.
        if used[3]:
            rep = np.flatnonzero(repetition != 1.0).tolist()
            host["seen"] = _pairs(rep, [prompt_ids[i] + output_ids[i] for i in rep])
        if used[4] or used[5]:
            gen = np.flatnonzero((frequency != 0) | (presence != 0)).tolist()
            host["generated"] = _pairs(gen, [output_ids[i] for i in gen])
        min_new = [p.min_new_tokens for p in params]
        if any(min_new):
            ban = [i for i, (k, m) in enumerate(zip(steps, min_new)) if k < m]
            ban_ids = [
                sorted({t for t in eos_token_ids + params[i].stop_token_ids if t < V}) for i in ban
            ]
            host["banned"] = _pairs(ban, ban_ids)
        if any(p.logit_bias for p in params):
            host["bias_pairs"], host["bias_values"] = _bias_arrays(params, V)
        filter_sets = row_filter_sets(top_ks, floats[1, :n], floats[2, :n], V) if per_filter_set else None
        dev = _to_device({name: a for name, a in host.items() if a is not None}, device)
        ints, floats = dev["ints"][:, :n], dev["floats"][:, :n]  # [3, B], [6, B]
        return cls(
            temperatures=floats[0].view(n, 1),
            greedy=dev["greedy"],
            top_ks=ints[0],
            top_ps=floats[1],
            min_ps=floats[2],
            seeds=ints[1],
            steps=ints[2],
            repetition_penalties=floats[3],
            frequency_penalties=floats[4].view(n, 1),
            presence_penalties=floats[5].view(n, 1),
            seen=_unstack(dev.get("seen")),
            generated=_unstack(dev.get("generated")),
            banned=_unstack(dev.get("banned")),
            all_greedy=num_greedy == n,
            any_greedy=num_greedy > 0,
            top_k_max=int(top_ks.max(initial=0, where=top_ks < V)),
            use_top_p=bool(used[1]),
            use_min_p=bool(used[2]),
            bias=_with_values(dev.get("bias_pairs"), dev.get("bias_values")),
            filter_sets=filter_sets,
        )


def _float_params(params: list[SamplingParams]) -> np.ndarray:
    """[6, B] float64 as the requests gave them (flags are read before the float32 cast):
    temperature, top_p, min_p, repetition, frequency and presence penalties."""
    return np.array(
        [
            [p.temperature for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            [p.repetition_penalty for p in params],
            [p.frequency_penalty for p in params],
            [p.presence_penalty for p in params],
        ],
        dtype=np.float64,
    )


# The rows of `values` in SamplingBatch.build at their neutral values: top_p <= 1 and min_p >= 0,
# so a row that moves one uses it. (Row 0, the temperature, is not asked.)
_NEUTRAL = np.array([[1.0], [1.0], [0.0], [1.0], [0.0], [0.0]])


def _to_float32_limits(floats: np.ndarray) -> None:
    """floats: [6, B] float32 as in SamplingBatch.build, changed in place. Values too small for
    float32 to act on act as their limit (see sampling_params): top_p keeps the top token,
    min_p cuts nothing, a repetition penalty stays finite. Temperatures are done: rows below
    MIN_TEMPERATURE are greedy."""
    top_p, min_p, repetition = floats[1], floats[2], floats[3]
    np.maximum(top_p, MIN_PROBABILITY, out=top_p)
    min_p[min_p < MIN_PROBABILITY] = 0.0
    np.maximum(repetition, MIN_REPETITION_PENALTY, out=repetition)


def _pairs(rows: list[int], id_lists: list[list[int]]) -> np.ndarray | None:
    """[2, N] int64: each row repeated once per id of its list, over the ids; None if no ids."""
    lens = [len(ids) for ids in id_lists]
    total = sum(lens)
    if total == 0:
        return None
    # np.fromiter is several times faster than torch.tensor on a long flat Python list.
    ids = np.fromiter(chain.from_iterable(id_lists), dtype=np.int64, count=total)
    return np.stack([np.repeat(np.asarray(rows, dtype=np.int64), lens), ids])


def _unstack(pairs: Tensor | None) -> tuple[Tensor, Tensor] | None:
    return None if pairs is None else (pairs[0], pairs[1])


def _bias_arrays(params: list[SamplingParams], vocab_size: int) -> tuple[Any, Any]:
    """[2, N] int64 (rows, ids) and [N] float32 biases of the rows with a logit_bias; ids
    outside the vocabulary (refused before a request is queued) are left out."""
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        for token, value in (p.logit_bias or {}).items():
            if token < vocab_size:
                rows.append(i)
                ids.append(token)
                values.append(value)
    if not rows:
        return None, None
    return np.array([rows, ids], dtype=np.int64), np.array(values, dtype=np.float32)


def _with_values(
    pairs: Tensor | None, values: Tensor | None
) -> tuple[Tensor, Tensor, Tensor] | None:
    return None if pairs is None or values is None else (pairs[0], pairs[1], values)


_TORCH_DTYPES = {np.int64: torch.int64, np.float32: torch.float32, np.bool_: torch.bool}


def _to_device(arrays: dict[str, np.ndarray], device: torch.device | str) -> dict[str, Tensor]:
    """The arrays on `device` after one non-blocking host-to-device copy: their bytes packed one
    after another (each from a 16-byte boundary), then viewed back with their dtypes and shapes.
    (Each copy costs the host more than packing a few KiB does.)"""
    packed, starts = bytearray(), {}
    for name, a in arrays.items():
        starts[name] = len(packed)
        packed += a.tobytes()
        packed += bytes(-len(packed) % 16)
    on_device = torch.frombuffer(packed or bytearray(16), dtype=torch.uint8)
    on_device = on_device.to(device, non_blocking=True)
    whole: dict[torch.dtype, Tensor] = {}  # the buffer viewed as each dtype
    out = {}
    for name, a in arrays.items():
        dtype = _TORCH_DTYPES[a.dtype.type]
        if dtype not in whole:
            whole[dtype] = on_device.view(dtype)
        at = starts[name] // a.itemsize
        out[name] = whole[dtype][at : at + a.size].view(a.shape)
    return out


def apply_penalties_and_masks(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """logits: [B, V] float32, modified in place and returned. Repetition penalty divides
    positive (multiplies negative) logits of prompt+output tokens; frequency and presence
    penalties subtract count * f and p from output tokens; logit biases are added; banned
    tokens become -inf."""
    if batch.seen is not None:
        rows, ids = batch.seen
        vals = logits[rows, ids]  # [N]; duplicates all write the same value back
        penalty = batch.repetition_penalties[rows]
        logits[rows, ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
    if batch.generated is not None:
        rows, ids = batch.generated
        counts = torch.zeros_like(logits)  # [B, V]
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=logits.dtype), accumulate=True)
        present = counts > 0
        logits -= counts.mul_(batch.frequency_penalties)
        logits -= present * batch.presence_penalties
    if batch.bias is not None:  # before the bans: a bias can't lift a banned token
        rows, ids, values = batch.bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if batch.banned is not None:
        logits[batch.banned] = float("-inf")
    return logits


def sample(logits: Tensor, batch: SamplingBatch, use_kernel: bool = False) -> Tensor:
    """logits: [B, V] float32 (penalized in place). Returns [B] int64 token ids: the argmax on
    greedy rows, else a draw from softmax(logits / T) restricted by top-k, top-p, min-p.
    use_kernel: filter and draw in one Triton kernel (rollout_kernels.sampling, same noise,
    one pass per filter over each row) instead of ~20 torch ops over [B, V] int64 temporaries.
    A batch built per_filter_set launches the kernel once for the rows of each filter set, so
    that every row's draw is the same bits whatever else is in the batch (deterministic
    inference)."""
    apply_penalties_and_masks(logits, batch)
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    if batch.filter_sets is not None:
        return sample_per_filter_set(logits, batch)
    if use_kernel:
        from rollout_kernels.sampling import sample_tokens

        return sample_tokens(
            logits, batch.temperatures, batch.greedy, batch.top_ks, batch.top_ps, batch.min_ps,
            batch.seeds, batch.steps,
            use_top_k=bool(batch.top_k_max), use_top_p=batch.use_top_p, use_min_p=batch.use_min_p,
        )  # fmt: skip
    B, V = logits.shape
    step = max(1, _CHUNK_ELEMS // V)
    tokens = torch.cat(
        [_sample_rows(logits[i : i + step], batch, slice(i, i + step)) for i in range(0, B, step)]
    )
    if batch.any_greedy:
        tokens = torch.where(batch.greedy, logits.argmax(dim=-1), tokens)
    return tokens


def _sample_rows(logits: Tensor, batch: SamplingBatch, rows: slice) -> Tensor:
    """logits: [R, V] for batch rows `rows`. Returns [R] int64 sampled ids."""
    x = logits / batch.temperatures[rows]  # [R, V]
    neg_inf = float("-inf")
    if batch.top_k_max:
        k = batch.top_ks[rows, None]  # [R, 1]
        kth = x.topk(batch.top_k_max, dim=-1).values  # [R, K] descending
        cut = kth.gather(1, (k - 1).clamp(max=batch.top_k_max - 1))
        x.masked_fill_(x < torch.where(k <= batch.top_k_max, cut, neg_inf), neg_inf)
    if batch.use_top_p:
        top_p = batch.top_ps[rows, None]  # [R, 1]
        probs = x.softmax(dim=-1)
        sorted_p = probs.sort(dim=-1, descending=True).values
        # Keep the most likely tokens until their mass reaches top_p (the first always stays:
        # also where logits / T overflowed and the probabilities are nan).
        n_keep = ((sorted_p.cumsum(dim=-1) - sorted_p) < top_p).sum(dim=-1, keepdim=True)
        n_keep.clamp_(min=1)
        cut = torch.where(top_p < 1, sorted_p.gather(1, n_keep - 1), 0.0)
        x.masked_fill_(probs < cut, neg_inf)
    if batch.use_min_p:
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p)
        floor = x.amax(dim=-1, keepdim=True) + batch.min_ps[rows, None].log()
        x.masked_fill_(x < floor, neg_inf)
    x += gumbel_noise(batch.seeds[rows], batch.steps[rows], x.shape[-1])
    return x.argmax(dim=-1)


def gumbel_noise(seeds: Tensor, steps: Tensor, vocab_size: int) -> Tensor:
    """seeds, steps: [R] int64. Returns [R, V] float32 standard Gumbel noise, always finite;
    element (r, t) is a pure function of (seeds[r], steps[r], t), whatever the batch."""
    key = _mix64_(_mix64_(seeds + _GOLDEN) ^ steps)  # [R]
    offsets = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device) * _GOLDEN
    # [R, V]: the splitmix64 stream seeded with `key`. Its last step (z ^= z >>> 31) leaves the
    # top 31 bits as they are, and only the top 23 are used: skip it.
    bits = _mix64_(key[:, None] + offsets, rounds=2)
    return _gumbel_from_top_bits(bits)


def _gumbel_from_top_bits(bits: Tensor) -> Tensor:
    """The top 23 bits of int64 `bits` -> Gumbel float32. The arithmetic shift gives a signed
    v in [-2^22, 2^22); u = (v + 2^22 + 1/2) / 2^23 is exact in float32 and never 0 or 1."""
    u = (bits >> 41).float().add_(2**22 + 0.5).mul_(2.0**-23)
    return u.log_().neg_().log_().neg_()


def _mix64_(z: Tensor, rounds: int = 3) -> Tensor:
    """splitmix64's finalizer on int64 with wraparound, in place (callers pass a fresh tensor).
    `>>` is arithmetic in torch, so each shift is masked to be logical."""
    for shift, mult in ((30, _MIX1), (27, _MIX2), (31, None))[:rounds]:
        z ^= (z >> shift).bitwise_and_((1 << (64 - shift)) - 1)
        if mult is not None:
            z *= mult
    return z
