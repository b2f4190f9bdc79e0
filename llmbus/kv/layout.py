"""The paged KV-cache layout, defined once.

Every layer owns one cache tensor shaped ``[2, num_blocks, block_size, num_kv_heads, head_dim]``:
index 0 holds keys, index 1 values. A token's *slot* is ``block_id * block_size + offset``;
viewing ``cache[0]`` as ``[num_blocks * block_size, num_kv_heads, head_dim]`` makes the slot a
plain row index. The engine, the Triton kernels and kvpool all import this module, so a block means
the same bytes everywhere.

NOTE: this module stays torch-free so the gateway, router and kvpool index can import it; dtypes
are named by string ("float32", "float16", "bfloat16").
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's cache tensor."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, keys and values, in the model dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Slots of token positions ``[start, end)`` of a sequence with this block table."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]
