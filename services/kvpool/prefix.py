"""kvpool's prefix cache: the index plus the CPU and SSD tiers, with LRU, demotion and promotion.

No NATS and no asyncio (the service calls it); the clock is injected. Blocks arrive and leave in
the tier-0 format (uint8 rows ``[n, block_bytes]``) and are stored in each tier's own format.

Invariants:
- a cached block lives in exactly one kvpool tier (cpu or ssd): demotion moves it down, promotion
  moves it up;
- making room in the CPU tier demotes its least recently used unpinned block to the SSD tier,
  converting formats; making room in the SSD tier drops its least recently used unpinned block.
  A pinned block is never evicted: when only pinned blocks are left, the new block is not stored;
- a chain is touched last block first, so a prefix's first blocks are the last to be evicted
  (a chain with a hole is useless past the hole);
- an SSD block is indexed only after its file is fsynced; a corrupt one is dropped, never served.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmbus.kv.formats import parse_kv_format
from llmbus.kv.index import POOL_TIERS, PrefixIndex
from llmbus.kv.tier_cpu import CpuTier
from llmbus.kv.tier_format import BlockCodec, parse_tier_format
from llmbus.kv.tier_ssd import SsdTier
from services.kvpool.config import PrefixConfig

log = logging.getLogger("llmbus.kvpool")

@dataclass
class TierCounters:
    lookups: int = 0  # blocks asked of this tier (reached in a chain walk)
    hits: int = 0  # blocks served from this tier
    evictions: int = 0  # blocks that left this tier to make room (demoted or dropped)
    demotions: int = 0  # blocks moved from this tier to the next
    promotions: int = 0  # blocks moved into this tier from the next


class PrefixCache:
    def __init__(self, config: PrefixConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        tier0 = parse_kv_format(config.kv_format)
        self.codec = BlockCodec(config.layout, tier0)
        self.fmt = {"t0": tier0, "cpu": parse_tier_format(config.cpu_format, tier0),
                    "ssd": parse_tier_format(config.ssd_format, tier0)}  # fmt: skip
        self.block_bytes = self.codec.block_bytes()
        self.index = PrefixIndex(clock=clock)
        self.cpu = CpuTier(config.cpu_bytes, self.codec.block_bytes(self.fmt["cpu"]))
        self.ssd = (SsdTier(config.ssd_dir, config.ssd_bytes, self.codec.block_bytes(self.fmt["ssd"]))
                    if config.ssd_bytes else None)  # fmt: skip
        self.counters = {t: TierCounters() for t in POOL_TIERS}
        self.rejected = 0  # blocks not stored because every resident block was pinned
        self.ssd_errors = 0  # SSD writes that failed (their blocks dropped)

    def close(self) -> None:
        self.cpu.close()

    def restore(self) -> int:
        """Re-index the SSD tier's valid files (start-up); returns how many blocks came back."""
        if self.ssd is None:
            return 0
        blocks = self.ssd.scan()
        for b in blocks:
            if b.kv_format != self.fmt["ssd"].name:  # written under another configuration (its size: scan drops it)
                self.ssd.delete(b.block_hash)
                continue
            self.index.add(b.block_hash, "ssd", parent=b.parent, token_count=b.token_count)
        return self.index.count("ssd")

    # --- store --------------------------------------------------------------------------------

    def missing(self, hashes: list[bytes]) -> list[int]:
        """Positions of ``hashes`` that no kvpool tier holds."""
        return [i for i, h in enumerate(hashes) if self.index.tier_of(h) is None]

    def store(self, hashes: list[bytes], rows: torch.Tensor, *, parent: bytes | None = None) -> tuple[int, int]:
        """Cache a chain's blocks (tier-0 rows, one per hash). Returns (stored, already present)."""
        self._check_rows(rows, len(hashes))
        todo = self.missing(hashes)
        present = len(hashes) - len(todo)
        stored = 0
        if todo:
            same = self.fmt["cpu"] == self.fmt["t0"]  # NOTE: then each row goes straight into its slot
            converted = None if same else self.codec.convert(rows[torch.tensor(todo)], self.fmt["t0"], self.fmt["cpu"])
            for j, i in enumerate(todo):
                prev = hashes[i - 1] if i else parent
                stored += self._put_cpu(hashes[i], rows[i] if same else converted[j], prev)
        self._touch_chain(hashes)
        return stored, present

    def _put_cpu(self, h: bytes, data: torch.Tensor, parent: bytes | None, token_count: int = 0) -> int:
        tokens = token_count or self.config.layout.block_size
        if self.cpu.slots and (not self.cpu.full or self._evict("cpu")):
            self.cpu.put(h, data.numpy().data)
            self.index.add(h, "cpu", parent=parent, token_count=tokens)
            return 1
        if self.cpu.slots == 0 and self._put_ssd(h, self.codec.convert(data[None], self.fmt["cpu"], self.fmt["ssd"])[0],
                                                 parent, tokens):  # fmt: skip
            return 1
        self.rejected += 1
        return 0

    def _put_ssd(self, h: bytes, data: torch.Tensor, parent: bytes | None, tokens: int) -> bool:
        if self.ssd is None:
            return False
        need = self.ssd.size_for(data.numel())
        if need > self.ssd.capacity_bytes:
            return False
        while self.ssd.free_bytes < need:
            if not self._evict("ssd"):
                return False
        try:
            self.ssd.put(h, data.numpy().data, self.fmt["ssd"].name, parent=parent, token_count=tokens)
        except OSError as exc:  # the disk full, the directory gone: the block is dropped, not stored
            self.ssd_errors += 1
            if self.ssd_errors == 1 or self.ssd_errors % 1000 == 0:
                log.warning("SSD tier: could not write a block (%d so far): %s", self.ssd_errors, exc)
            return False
        self.index.add(h, "ssd", parent=parent, token_count=tokens)
        return True

    def _evict(self, tier: str) -> bool:
        """Make room for one block in ``tier``: demote (cpu) or drop (ssd) its LRU unpinned block."""
        victim = next(iter(self.index.victims(tier)), None)
        if victim is None:
            return False
        c = self.counters[tier]
        c.evictions += 1
        if tier == "cpu":
            data = torch.frombuffer(bytearray(self.cpu.get(victim)), dtype=torch.uint8)
            e = self.index.entry(victim)
            self.cpu.delete(victim)
            self.index.remove(victim, "cpu")
            down = self.codec.convert(data[None], self.fmt["cpu"], self.fmt["ssd"])[0] if self.ssd else None
            if down is not None and self._put_ssd(victim, down, e.parent, e.token_count):
                c.demotions += 1
        else:
            self.ssd.delete(victim)
            self.index.remove(victim, "ssd")
        return True

    # --- fetch --------------------------------------------------------------------------------

    def fetch(self, hashes: list[bytes], start: int = 0, max_blocks: int | None = None) -> tuple[torch.Tensor, dict[str, int]]:
        """Tier-0 rows of the longest run of ``hashes[start:]`` in kvpool's tiers, and how many
        blocks came from each tier. SSD hits are promoted to the CPU tier."""
        limit = len(hashes) - start if max_blocks is None else min(max_blocks, len(hashes) - start)
        rows: list[tuple[str, torch.Tensor]] = []
        served = {t: 0 for t in POOL_TIERS}
        for i in range(start, start + max(0, limit)):
            h = hashes[i]
            self.counters["cpu"].lookups += 1
            tier = self.index.tier_of(h)
            if tier != "cpu":
                self.counters["ssd"].lookups += 1
            got = self._read(h, tier)
            if got is None:
                break
            rows.append(got)
            served[tier] += 1
            self.counters[tier].hits += 1
        if not rows:
            return torch.zeros((0, self.block_bytes), dtype=torch.uint8), served
        out = self._to_tier0(hashes[start : start + len(rows)], rows)
        self._touch_chain(hashes[start : start + len(rows)])
        return out, served

    def _read(self, h: bytes, tier: str | None) -> tuple[str, torch.Tensor] | None:
        if tier == "cpu":
            return "cpu", torch.frombuffer(bytearray(self.cpu.get(h)), dtype=torch.uint8)
        if tier == "ssd":
            got = self.ssd.get(h)
            if got is None:  # corrupt, truncated or another layout's: dropped by the SSD tier
                self.index.remove(h, "ssd")
                return None
            return "ssd", torch.frombuffer(bytearray(got[0]), dtype=torch.uint8)
        return None

    def _to_tier0(self, hashes: list[bytes], rows: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
        out = torch.empty((len(rows), self.block_bytes), dtype=torch.uint8)
        for tier in POOL_TIERS:
            idx = [i for i, (t, _) in enumerate(rows) if t == tier]
            if idx:
                out[torch.tensor(idx)] = self.codec.convert(torch.stack([rows[i][1] for i in idx]), self.fmt[tier], self.fmt["t0"])
        ssd_idx = [i for i, (t, _) in enumerate(rows) if t == "ssd"]
        if ssd_idx:  # promotion on hit: SSD -> CPU, converted to the CPU format
            up = self.codec.convert(torch.stack([rows[i][1] for i in ssd_idx]), self.fmt["ssd"], self.fmt["cpu"])
            for j, i in enumerate(ssd_idx):
                self._promote(hashes[i], up[j])
        return out

    def _promote(self, h: bytes, data: torch.Tensor) -> None:
        if not self.cpu.slots:
            return
        e = self.index.entry(h)
        self.ssd.delete(h)
        self.index.remove(h, "ssd")
        if (not self.cpu.full or self._evict("cpu")) and h not in self.cpu:
            self.cpu.put(h, data.numpy().data)
            self.index.add(h, "cpu", parent=e.parent, token_count=e.token_count)
            self.counters["cpu"].promotions += 1
        else:  # no room above: keep it where it was
            self._put_ssd(h, self.codec.convert(data[None], self.fmt["cpu"], self.fmt["ssd"])[0], e.parent, e.token_count)

    # --- helpers ------------------------------------------------------------------------------

    def _touch_chain(self, hashes: list[bytes]) -> None:
        for h in reversed(hashes):
            tier = self.index.tier_of(h)
            if tier is not None:
                self.index.touch(h, tier)

    def _check_rows(self, rows: torch.Tensor, n: int) -> None:
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape != (n, self.block_bytes):
            raise ValueError(f"expected uint8 [{n}, {self.block_bytes}] tier-0 blocks, got {rows.dtype} {list(rows.shape)}")

    def tier_usage(self, tier: str) -> tuple[int, int, int]:
        """(bytes used, byte capacity, blocks) of a kvpool tier."""
        if tier == "cpu":
            return self.cpu.used_bytes, self.cpu.capacity_bytes, len(self.cpu)
        if self.ssd is None:
            return 0, 0, 0
        return self.ssd.used_bytes, self.ssd.capacity_bytes, self.index.count("ssd")
