"""Kernels whose variants the interpreter runs on CPU also compile for an H100 (sm_90): the
compiler's rules, the launch settings' shared memory and the width of the loads are checked
without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_the_lora_and_skinny_kernels_compile_for_sm90():
    try:
        from triton.backends.nvidia import compiler  # noqa: F401 - the CUDA backend ships ptxas
    except ImportError:
        pytest.skip("this Triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "sm90_compile.py")
    run = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = [line for line in run.stdout.splitlines() if line.endswith("bytes")]
    assert len(compiled) == 8, run.stdout
    # Launched with PDL, each waits for the kernel before it and lets the next one start.
    with_pdl, without = compiled[:1] + compiled[2:], compiled[1]
    assert all(" pdl=2 " in line for line in with_pdl) and " pdl=0 " in without, run.stdout
    # Every global load and store at least 4 bytes wide: a 2-byte one means a mask or an
    # address Triton could not prove aligned, and a kernel that reads element by element
    # (the LoRA expand read B that way until its rank mask was rounded to 16).
    assert all(" narrow=0 " in line for line in compiled), run.stdout
