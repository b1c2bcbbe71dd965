"""Triton kernels and their launchers; imported only when a Triton path runs."""
