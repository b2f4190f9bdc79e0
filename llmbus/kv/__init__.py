"""Paged KV cache: layout, block hashing and storage formats, shared by engine, kernels and kvpool."""

from llmbus.kv.layout import KVLayout

__all__ = ["KVLayout"]
