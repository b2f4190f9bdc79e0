"""kvpool's configuration: the handoff lease pool, and the prefix cache's tiers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmbus.kv.formats import KV_FORMATS, parse_kv_format
from llmbus.kv.layout import KVLayout

TIER_FORMATS = ("same",) + KV_FORMATS  # "same": the tier-0 (workers') format, lossless


@dataclass(frozen=True)
class PrefixConfig:
    """The prefix cache: one deployment's block layout and tier-0 format, and kvpool's two tiers."""

    layout: KVLayout  # the served model's KV layout (block_size included)
    kv_format: str = "model"  # tier 0: the workers' own cache format (part of every prefix hash)
    cpu_format: str = "same"
    cpu_bytes: int = 1 << 30  # shared-memory budget of the CPU tier
    ssd_format: str = "same"
    ssd_bytes: int = 0  # file budget of the SSD tier; 0 disables it
    ssd_dir: Path | None = None  # where the SSD tier keeps its block files

    def __post_init__(self) -> None:
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {self.kv_format!r}")
        for name in ("cpu_format", "ssd_format"):
            if getattr(self, name) not in TIER_FORMATS:
                raise ValueError(f"{name} must be one of {TIER_FORMATS}, got {getattr(self, name)!r}")
        if self.cpu_bytes < 0 or self.ssd_bytes < 0:
            raise ValueError(f"tier budgets must be >= 0 bytes, got cpu {self.cpu_bytes}, ssd {self.ssd_bytes}")
        if self.ssd_bytes and self.ssd_dir is None:
            raise ValueError("an SSD tier (ssd_bytes > 0) needs ssd_dir")


def parse_layout(text: str) -> KVLayout:
    """``LAYERS,KV_HEADS,HEAD_DIM,BLOCK_SIZE,DTYPE`` (the ``--kv-layout`` option) -> KVLayout."""
    parts = text.split(",")
    if len(parts) != 5:
        raise ValueError(f"--kv-layout must be LAYERS,KV_HEADS,HEAD_DIM,BLOCK_SIZE,DTYPE, got {text!r}")
    try:
        nums = [int(p) for p in parts[:4]]
    except ValueError:
        raise ValueError(f"--kv-layout needs four integers then a dtype, got {text!r}") from None
    return KVLayout(*nums, dtype=parts[4].strip())


def format_layout(layout: KVLayout) -> str:
    return f"{layout.num_layers},{layout.num_kv_heads},{layout.head_dim},{layout.block_size},{layout.dtype}"


@dataclass(frozen=True)
class KVPoolConfig:
    block_bytes: int  # bytes of one block: KVLayout.bytes_per_block of the served model
    capacity_blocks: int  # blocks in the CPU tier (one shared-memory segment of block_bytes * capacity)
    max_ttl_s: float = 3600.0  # longest lease a client may ask for
    reclaim_interval_s: float = 1.0  # how often expired leases are swept even when nobody asks
    prefix: PrefixConfig | None = None  # None: no prefix cache (lookups miss, stores are refused)

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
        if self.prefix is not None:  # NOTE: else every handoff of this layout would fail at run time
            need = parse_kv_format(self.prefix.kv_format).bytes_per_block(self.prefix.layout)
            if self.block_bytes < need:
                raise ValueError(f"block_bytes {self.block_bytes} is less than one {self.prefix.kv_format} block of "
                                 f"the KV layout ({need} bytes)")

    @classmethod
    def from_layout(cls, layout: KVLayout, capacity_blocks: int, **kw) -> KVPoolConfig:
        return cls(block_bytes=layout.bytes_per_block, capacity_blocks=capacity_blocks, **kw)
