"""Triton kernels, one kernel and its launcher per file (installed as `rollout_kernels`)."""

from rollout_kernels.interpreter import interpreting, swap_once_a_launch

if interpreting():  # the kernels run on a CPU
    swap_once_a_launch()
