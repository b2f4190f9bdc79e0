"""kvpool's global prefix index: for each salted chained block hash, where the block lives.

Pure: no I/O, no torch, no asyncio; the clock is injected. Locations are ``(tier, worker)``:
``("t0", worker_id)`` is a worker's own paged cache (GPU memory, or RAM on CPU), ``("cpu", "")``
kvpool's shared-memory tier and ``("ssd", "")`` its file tier. Events follow the shape vLLM and
SGLang use for KV events (``BlockStored`` / ``BlockRemoved`` with hashes, parent, token count, tier).

Invariants:
- per kvpool tier (cpu, ssd) the index keeps an LRU order, oldest first; ``touch`` moves a block
  to the newest end. ``victims(tier)`` walks that order and skips pinned blocks, so a block under a
  live pin (lease) is never chosen for eviction;
- a pin covers a set of hashes until released or until its ``expires_at`` passes; ``unpin`` is
  idempotent and expired pins are reclaimed by every call that looks at pins;
- a hash is only useful as part of a chain: ``lookup`` counts, per location, how many blocks from
  the START of the chain are present there, stopping at the first gap.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

POOL_TIERS = ("cpu", "ssd")  # kvpool's own tiers, fastest first: eviction demotes along this order
TIERS = ("t0",) + POOL_TIERS
Location = tuple[str, str]  # (tier, worker); worker is "" for kvpool's tiers


@dataclass(frozen=True)
class BlockStored:
    """Blocks now held at ``(tier, worker)``; ``block_hashes`` chain on from ``parent_hash``."""

    block_hashes: list[bytes]
    parent_hash: bytes | None = None
    token_count: int = 0  # tokens per block (the block size)
    tier: str = "t0"
    worker: str = ""


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    tier: str = "t0"
    worker: str = ""


@dataclass
class Entry:
    parent: bytes | None = None
    token_count: int = 0
    where: dict[Location, float] = field(default_factory=dict)  # location -> last use (clock seconds)
    pins: int = 0


@dataclass
class Pin:
    pin_id: str
    hashes: list[bytes]
    expires_at: float


def _check_location(tier: str, worker: str) -> Location:
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    if tier == "t0" and not worker:
        raise ValueError("a tier-0 location needs the worker's instance id")
    return (tier, "" if tier in POOL_TIERS else worker)


class PrefixIndex:
    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._entries: dict[bytes, Entry] = {}
        self._lru: dict[str, OrderedDict[bytes, None]] = {t: OrderedDict() for t in POOL_TIERS}
        self._pins: dict[str, Pin] = {}
        # worker -> the blocks its tier 0 holds, oldest announced first (drop_worker's and limit_t0's work list)
        self._t0: dict[str, OrderedDict[bytes, None]] = {}
        self._ids = itertools.count(1)
        self.reclaimed_pins = 0

    # --- events -------------------------------------------------------------------------------

    def apply(self, event: BlockStored | BlockRemoved) -> None:
        if isinstance(event, BlockStored):
            parent = event.parent_hash
            for h in event.block_hashes:
                self.add(h, event.tier, event.worker, parent=parent, token_count=event.token_count)
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self.remove(h, event.tier, event.worker)
        else:
            raise ValueError(f"unknown KV event {type(event).__name__}")

    def add(self, h: bytes, tier: str, worker: str = "", *, parent: bytes | None = None, token_count: int = 0) -> None:
        loc = _check_location(tier, worker)
        e = self._entries.setdefault(h, Entry(parent, token_count))
        if parent is not None:
            e.parent = parent
        e.token_count = token_count or e.token_count
        if tier == "t0":
            held = self._t0.setdefault(worker, OrderedDict())
            held[h] = None
            held.move_to_end(h)
        e.where[loc] = self._clock()
        if tier in self._lru:
            self._lru[tier][h] = None
            self._lru[tier].move_to_end(h)

    def remove(self, h: bytes, tier: str, worker: str = "") -> bool:
        """Forget one location of ``h``; idempotent (False when it was not there)."""
        loc = _check_location(tier, worker)
        e = self._entries.get(h)
        if e is None or loc not in e.where:
            return False
        del e.where[loc]
        if tier == "t0":
            held = self._t0[worker]
            held.pop(h, None)
            if not held:
                del self._t0[worker]
        if tier in self._lru:
            self._lru[tier].pop(h, None)
        if not e.where and not e.pins:
            del self._entries[h]
        return True

    def t0_workers(self) -> dict[str, int]:
        """Workers with tier-0 blocks in the index, and how many each."""
        return {worker: len(held) for worker, held in self._t0.items()}

    def limit_t0(self, worker: str, max_blocks: int) -> int:
        """Forget ``worker``'s oldest-announced tier-0 blocks past ``max_blocks`` (what its cache
        holds at most: workers announce what they cache, not what they evict); returns how many."""
        held = self._t0.get(worker)
        excess = len(held) - max_blocks if held else 0
        for h in list(itertools.islice(held, excess)) if excess > 0 else ():
            self.remove(h, "t0", worker)
        return max(0, excess)

    def drop_worker(self, worker: str) -> int:
        """Forget every tier-0 location of a worker that went away; returns how many. Costs that
        worker's blocks, not the index's."""
        gone = list(self._t0.get(worker, ()))
        for h in gone:
            self.remove(h, "t0", worker)
        return len(gone)

    # --- queries ------------------------------------------------------------------------------

    def has(self, h: bytes, tier: str, worker: str = "") -> bool:
        e = self._entries.get(h)
        return e is not None and _check_location(tier, worker) in e.where

    def tier_of(self, h: bytes) -> str | None:
        """The fastest kvpool tier holding ``h``, or None."""
        e = self._entries.get(h)
        if e is not None:
            for t in POOL_TIERS:
                if (t, "") in e.where:
                    return t
        return None

    def entry(self, h: bytes) -> Entry | None:
        return self._entries.get(h)

    def lookup(self, hashes: list[bytes]) -> dict[Location, int]:
        """Longest cached prefix of ``hashes`` per location, in blocks (locations with 0 omitted)."""
        out: dict[Location, int] = {}
        alive: set[Location] | None = None
        for i, h in enumerate(hashes):
            e = self._entries.get(h)
            here = set(e.where) if e else set()
            alive = here if alive is None else alive & here
            if not alive:
                break
            for loc in alive:
                out[loc] = i + 1
        return out

    def pool_prefix(self, hashes: list[bytes], start: int = 0) -> int:
        """Blocks of ``hashes[start:]`` found consecutively in kvpool's tiers (any mix of cpu, ssd)."""
        n = 0
        for h in hashes[start:]:
            if self.tier_of(h) is None:
                break
            n += 1
        return n

    def touch(self, h: bytes, tier: str, worker: str = "") -> None:
        loc = _check_location(tier, worker)
        e = self._entries.get(h)
        if e is None or loc not in e.where:
            return
        e.where[loc] = self._clock()
        if tier in self._lru:
            self._lru[tier].move_to_end(h)

    def lru_order(self, tier: str) -> list[bytes]:
        """Every block of a kvpool tier, least recently used first (pinned ones included)."""
        return list(self._lru[tier])

    def victims(self, tier: str) -> Iterable[bytes]:
        """Eviction candidates of a kvpool tier, least recently used first; never a pinned block."""
        self.reclaim_expired()
        for h in list(self._lru[tier]):
            if not self._entries[h].pins:
                yield h

    def __len__(self) -> int:
        """Blocks known at any location (or pinned)."""
        return len(self._entries)

    def count(self, tier: str) -> int:
        return len(self._lru[tier])

    # --- pins (leases on blocks) --------------------------------------------------------------

    def pin(self, hashes: list[bytes], ttl_s: float) -> str:
        """Protect ``hashes`` from eviction for ``ttl_s`` seconds; returns the pin id."""
        if not ttl_s > 0:
            raise ValueError(f"pin ttl_s must be > 0, got {ttl_s}")
        missing = [h.hex() for h in hashes if h not in self._entries]
        if missing:
            raise ValueError(f"cannot pin unknown block {missing[0]}")
        self.reclaim_expired()
        pin = Pin(f"pin-{next(self._ids)}-{secrets.token_hex(8)}", list(hashes), self._clock() + ttl_s)  # unguessable
        for h in pin.hashes:
            self._entries[h].pins += 1
        self._pins[pin.pin_id] = pin
        return pin.pin_id

    def unpin(self, pin_id: str) -> bool:
        """Idempotent: False for an unknown, released or expired pin."""
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return False
        for h in pin.hashes:
            e = self._entries.get(h)
            if e is None:
                continue
            e.pins -= 1
            if not e.pins and not e.where:
                del self._entries[h]
        return True

    def pinned(self, h: bytes) -> bool:
        e = self._entries.get(h)
        return e is not None and e.pins > 0

    def reclaim_expired(self) -> list[str]:
        now = self._clock()
        expired = [p.pin_id for p in self._pins.values() if p.expires_at <= now]
        for pid in expired:
            self.unpin(pid)
        self.reclaimed_pins += len(expired)
        return expired

    @property
    def active_pins(self) -> int:
        return len(self._pins)

