"""Triton kernels, one kernel and its launcher per file (installed as `rollout_kernels`)."""

import os

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # the kernels run on a CPU
    from rollout_kernels.interpreter import swap_once_a_launch

    swap_once_a_launch()
