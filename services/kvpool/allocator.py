"""kvpool's block allocator with leases. Pure: no I/O, no asyncio; the clock is injected.

Invariants:
- every block is either free or held by exactly one live lease;
- ``release`` is idempotent (False for an unknown, released or reclaimed lease);
- a lease whose ``expires_at`` has passed is reclaimed (its blocks freed) by the next operation
  that looks at the pool, so crashed or stuck holders cannot leak blocks for longer than their TTL.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass


class PoolExhausted(ValueError):
    """Not enough free blocks for an allocation."""


class UnknownLease(KeyError):
    """The lease does not exist: never granted, released, or reclaimed after expiry."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown lease"


@dataclass
class LeaseRecord:
    lease_id: str
    blocks: list[int]
    ttl_s: float
    expires_at: float
    owner: str = ""
    request_id: str = ""


class BlockAllocator:
    def __init__(self, capacity: int, *, clock: Callable[[], float] = time.time, max_ttl_s: float = 3600.0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 block, got {capacity}")
        if max_ttl_s <= 0:
            raise ValueError(f"max_ttl_s must be > 0, got {max_ttl_s}")
        self.capacity = capacity
        self.max_ttl_s = max_ttl_s
        self._clock = clock
        # NOTE: lowest free block first keeps allocation deterministic (tests assert exact handles).
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # a stack; pop() gives the lowest
        self._leases: dict[str, LeaseRecord] = {}
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(4)
        self.reclaimed_total = 0

    def _check_ttl(self, ttl_s: float) -> None:
        if not 0 < ttl_s <= self.max_ttl_s:
            raise ValueError(f"ttl_s must be in (0, {self.max_ttl_s}], got {ttl_s}")

    def allocate(self, num_blocks: int, ttl_s: float, *, owner: str = "", request_id: str = "") -> LeaseRecord:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._check_ttl(ttl_s)
        self.reclaim_expired()
        if num_blocks > len(self._free):
            raise PoolExhausted(f"kvpool has {len(self._free)} free blocks of {self.capacity}; {num_blocks} requested")
        blocks = [self._free.pop() for _ in range(num_blocks)]
        # NOTE: the random part makes a lease id unguessable: whoever holds it may read, write and release
        lease_id = f"{self._prefix}-{next(self._ids)}-{secrets.token_hex(8)}"
        lease = LeaseRecord(lease_id, blocks, ttl_s, self._clock() + ttl_s, owner, request_id)
        self._leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str) -> LeaseRecord:
        """The live lease, or UnknownLease."""
        self.reclaim_expired()
        lease = self._leases.get(lease_id)
        if lease is None:
            raise UnknownLease(f"unknown or expired lease {lease_id!r}")
        return lease

    def renew(self, lease_id: str, ttl_s: float) -> LeaseRecord:
        self._check_ttl(ttl_s)
        lease = self.get(lease_id)
        lease.ttl_s = ttl_s
        lease.expires_at = self._clock() + ttl_s
        return lease

    def release(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._free.extend(reversed(lease.blocks))
        self._free.sort(reverse=True)
        return True

    def reclaim_expired(self) -> list[str]:
        """Free every lease past its expiry; returns their ids."""
        now = self._clock()
        expired = [lid for lid, lease in self._leases.items() if lease.expires_at <= now]
        for lid in expired:
            self.release(lid)
        self.reclaimed_total += len(expired)
        return expired

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def leased_blocks(self) -> int:
        return self.capacity - len(self._free)

    @property
    def active_leases(self) -> int:
        return len(self._leases)
