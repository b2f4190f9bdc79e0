"""Attention and KV kernels: Triton kernels on GPU, each beside its pure-torch reference."""
