"""Triton kernels, each beside its launcher and a plain-PyTorch reference."""
