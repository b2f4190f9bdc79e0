"""kvpool's configuration: block byte size (from the KV layout) and capacity."""

from __future__ import annotations

from dataclasses import dataclass

from llmbus.kv.layout import KVLayout


@dataclass(frozen=True)
class KVPoolConfig:
    block_bytes: int  # bytes of one block: KVLayout.bytes_per_block of the served model
    capacity_blocks: int  # blocks in the CPU tier (one shared-memory segment of block_bytes * capacity)
    max_ttl_s: float = 3600.0  # longest lease a client may ask for
    reclaim_interval_s: float = 1.0  # how often expired leases are swept even when nobody asks

    def __post_init__(self) -> None:
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {self.block_bytes}")
        if self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")
        if self.block_bytes * self.capacity_blocks > 1 << 40:
            raise ValueError("the CPU tier would exceed 1 TiB; lower capacity_blocks")
        if self.max_ttl_s <= 0:
            raise ValueError(f"max_ttl_s must be > 0, got {self.max_ttl_s}")
        if self.reclaim_interval_s <= 0:
            raise ValueError(f"reclaim_interval_s must be > 0, got {self.reclaim_interval_s}")

    @classmethod
    def from_layout(cls, layout: KVLayout, capacity_blocks: int, **kw) -> KVPoolConfig:
        return cls(block_bytes=layout.bytes_per_block, capacity_blocks=capacity_blocks, **kw)
