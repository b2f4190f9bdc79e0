"""kvpool's block allocator: leases, idempotent release, reclaim on expiry (injected clock)."""

import pytest

from llmbus.bus.shm import lease_spans
from services.kvpool.allocator import BlockAllocator, PoolExhausted, UnknownLease


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_allocate_lowest_blocks_first_and_exhaustion():
    a = BlockAllocator(5, clock=Clock())
    first = a.allocate(2, 10)
    second = a.allocate(3, 10)
    assert (first.blocks, second.blocks) == ([0, 1], [2, 3, 4])
    assert (a.free_blocks, a.leased_blocks, a.active_leases) == (0, 5, 2)
    with pytest.raises(PoolExhausted, match="0 free blocks of 5; 1 requested"):
        a.allocate(1, 10)
    assert a.release(first.lease_id) is True
    assert a.allocate(2, 10).blocks == [0, 1]


def test_lease_and_pin_ids_cannot_be_guessed_from_one_another():
    """Whoever holds a lease id may release it: knowing one id (or the pool's) must not give the next."""
    import re

    from llmbus.kv.index import PrefixIndex

    pool = BlockAllocator(8)
    ids = [pool.allocate(1, 10.0).lease_id for _ in range(3)]
    index = PrefixIndex()
    index.add(b"h" * 16, "cpu")
    pins = [index.pin([b"h" * 16], 10.0) for _ in range(3)]
    for made in (ids, pins):
        assert all(re.fullmatch(r"[0-9a-z]+-\d+-[0-9a-f]{16}", i) for i in made), made
        assert len({i.rsplit("-", 1)[1] for i in made}) == 3


def test_release_is_idempotent():
    a = BlockAllocator(4, clock=Clock())
    lease = a.allocate(3, 10)
    assert a.release(lease.lease_id) is True
    assert a.release(lease.lease_id) is False
    assert a.release("never-granted") is False
    assert (a.free_blocks, a.leased_blocks) == (4, 0)


def test_expired_leases_are_reclaimed_and_renew_extends():
    clock = Clock()
    a = BlockAllocator(4, clock=clock)
    short = a.allocate(2, 5)
    long = a.allocate(1, 20)
    clock.now += 4
    assert a.renew(short.lease_id, 5).expires_at == clock.now + 5
    clock.now += 4.5  # short renewed at +4 for 5 s: still alive at +8.5
    assert a.reclaim_expired() == []
    clock.now += 1  # +9.5: past the renewed expiry
    assert a.get(long.lease_id).blocks == [2]
    assert a.reclaimed_total == 1 and a.free_blocks == 3
    with pytest.raises(UnknownLease, match="unknown or expired lease"):
        a.get(short.lease_id)
    with pytest.raises(UnknownLease):
        a.renew(short.lease_id, 5)
    assert a.release(short.lease_id) is False  # reclaimed: release stays harmless
    clock.now += 20
    assert a.allocate(4, 1).blocks == [0, 1, 2, 3]  # allocation sweeps first
    assert a.reclaimed_total == 2


def test_validation_messages():
    with pytest.raises(ValueError, match="capacity"):
        BlockAllocator(0)
    a = BlockAllocator(2, max_ttl_s=10)
    with pytest.raises(ValueError, match="num_blocks"):
        a.allocate(0, 1)
    with pytest.raises(ValueError, match=r"ttl_s must be in \(0, 10"):
        a.allocate(1, 11)


def test_lease_spans_merge_adjacent_blocks():
    assert lease_spans([3, 4, 0], 10, 0, 30) == [(30, 20), (0, 10)]
    assert lease_spans([3, 4, 0], 10, 15, 10) == [(45, 5), (0, 5)]
    assert lease_spans([2], 10, 10, 0) == []
    with pytest.raises(ValueError, match="outside the lease's 20 bytes"):
        lease_spans([1, 2], 10, 15, 6)
