"""The Triton decode kernel's launch, set by a benchmark before its engine captures CUDA graphs:
keys per piece of a request's split-KV and keys per loop step (bf16), to compare them inside
the engine (bench_attention.py times the kernel alone)."""

from __future__ import annotations


def set_decode_launch(split_keys: int | None, block_n: int | None) -> None:
    """Sets the kernel's piece length and block size where given (None keeps the default)."""
    from rollout_kernels import decode_attention

    for value, what in ((split_keys, "split_keys"), (block_n, "block_n")):
        if value is not None and (value < 16 or value & (value - 1)):
            raise SystemExit(f"--decode-{what.replace('_', '-')} must be a power of two >= 16, got {value}")
    if split_keys is not None:
        decode_attention.MIN_KEYS_PER_SPLIT = split_keys
    if block_n is not None:
        decode_attention.BLOCK_N = block_n
