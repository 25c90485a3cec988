"""Compiles kernels of rollout_kernels for an H100 (sm_90) without a GPU, as Triton does before
a launch: what the interpreter cannot check (the compiler's own rules, the launch settings'
shared memory, how wide the loads are). Integer and pointer arguments are taken divisible by
16, as Triton's launcher specializes them for a real model's shapes. Run by
test_kernels_compile.py in a process without TRITON_INTERPRET; prints one line per variant
compiled (with its count of 2-byte global loads and stores: element-by-element access) and
exits non-zero at the first that does not compile."""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import re  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from rollout_kernels import lora_expand, lora_shrink, skinny_gemm  # noqa: E402
from rollout_kernels.lora_segments import LONG_BLOCK_M  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)


def compile_variant(
    kernel, constexprs: dict, options: dict, int32: set[str], float32: set[str]
) -> None:
    """Pointer arguments are bf16 unless named in `int32` or `float32`; the rest are i32."""

    def arg_type(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if not name.endswith("_ptr"):
            return "i32"
        return "*i32" if name in int32 else "*fp32" if name in float32 else "*bf16"

    signature = {name: arg_type(name) for name in kernel.arg_names}
    unspecialized = set(getattr(kernel, "do_not_specialize", ())) | set(constexprs)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if name not in unspecialized and i not in unspecialized
    }
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
        target=H100, options=options,
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    narrow = len(re.findall(r"(?:ld|st)\.global\.b16", ptx))
    pdl = len(re.findall(r"griddepcontrol\.(?:wait|launch_dependents)", ptx))
    print(kernel.__name__, constexprs, options, f"narrow={narrow} pdl={pdl}",
          len(compiled.asm["cubin"]), "bytes", flush=True)  # fmt: skip


def main() -> None:
    # Every variant as the engine launches it on an H100: with programmatic dependent launch
    # (rollout_kernels.pdl); the skinny GEMM also without it.
    pdl = {"launch_pdl": True}
    for use_pdl in (True, False):
        compile_variant(
            skinny_gemm._skinny_gemm_kernel,
            {"HAS_BIAS": True, "DOT_PRECISION": "tf32", "BLOCK_M": skinny_gemm.MAX_ROWS,
             "BLOCK_N": 32, "BLOCK_K": 512, "USE_PDL": use_pdl},
            {"num_warps": 4, "num_stages": 5, "launch_pdl": use_pdl},
            int32=set(), float32=set(),
        )  # fmt: skip
    segments = {"order_ptr", "block_slot_ptr", "block_first_ptr", "block_rows_ptr"}
    # A decode batch's blocks of 16 rows and a long prefill's of 64 (block_m_for).
    for block_m, block_n, block_k in ((16, 16, 256), (LONG_BLOCK_M, 64, 256)):
        compile_variant(
            lora_shrink._lora_shrink_kernel,
            {"NUM_SLOTS": 9, "DOT_PRECISION": "tf32", "BLOCK_M": block_m,
             "BLOCK_N": block_n, "BLOCK_K": block_k, "USE_PDL": True},
            {"num_warps": 4, "num_stages": 3, **pdl},
            int32={"ranks_ptr"} | segments, float32={"y_ptr"},
        )  # fmt: skip
    for block_m, block_n, warps, one_block, n_tiles, stages in (
        (16, 256, 8, True, 1, 3), (16, 256, 8, True, 8, 2), (16, 256, 8, False, 2, 3),
        (LONG_BLOCK_M, 64, 4, True, 8, 3),
    ):
        compile_variant(
            lora_expand._lora_expand_kernel,
            {"NUM_SLOTS": 9, "DOT_PRECISION": "tf32", "BLOCK_M": block_m,
             "BLOCK_N": block_n, "BLOCK_R": 64, "N_TILES": n_tiles, "ONE_R_BLOCK": one_block,
             "RANK_ALIGN": lora_expand.RANK_ALIGN, "COL_ALIGN": 16, "USE_PDL": True},
            {"num_warps": warps, "num_stages": stages, **pdl},
            int32={"ranks_ptr", "offsets_ptr"} | segments, float32={"y_ptr", "scales_ptr"},
        )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
