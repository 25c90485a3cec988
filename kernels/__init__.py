"""Triton kernels, one kernel and its launcher per file (installed as `rollout_kernels`)."""
