"""The prefix index (pure): events, longest prefix per location, LRU victims, pins with expiry."""

import pytest

from llmbus.kv.hashing import chain_hashes, root_hash
from llmbus.kv.index import BlockRemoved, BlockStored, PrefixIndex


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chain(salt: str, tokens: list[int], bs: int = 4) -> list[bytes]:
    return chain_hashes(root_hash("m", "model", salt), tokens, bs)


def test_events_and_longest_prefix_per_location():
    idx = PrefixIndex(clock=Clock())
    h = chain("", list(range(16)))  # 4 blocks
    idx.apply(BlockStored(h[:3], None, 4, "t0", "w1"))
    idx.apply(BlockStored(h[:2], None, 4, "cpu"))
    idx.apply(BlockStored(h[3:], h[2], 4, "ssd"))
    assert idx.entry(h[3]).parent == h[2] and idx.entry(h[1]).parent == h[0] and idx.entry(h[0]).parent is None
    assert idx.lookup(h) == {("t0", "w1"): 3, ("cpu", ""): 2}  # ssd holds block 3 only: no prefix there
    assert idx.pool_prefix(h) == 2 and idx.pool_prefix(h, start=3) == 1
    idx.apply(BlockStored(h[:3], None, 4, "t0", "w1"))  # again: the same three locations
    assert idx.t0_workers() == {"w1": 3}
    idx.apply(BlockRemoved([h[1]], "t0", "w1"))
    assert idx.lookup(h) == {("t0", "w1"): 1, ("cpu", ""): 2} and idx.t0_workers() == {"w1": 2}
    assert idx.remove(h[1], "t0", "w1") is False  # idempotent
    idx.apply(BlockStored(h[3:], h[2], 4, "t0", "w1"))
    assert idx.limit_t0("w1", 5) == 0 and idx.limit_t0("w1", 2) == 1  # the oldest announced goes: h[0]
    assert idx.lookup(h) == {("cpu", ""): 2} and idx.lookup(h[2:]) == {("t0", "w1"): 2}
    assert idx.drop_worker("w1") == 2 and idx.drop_worker("w1") == 0
    assert idx.lookup(h) == {("cpu", ""): 2} and idx.t0_workers() == {}
    with pytest.raises(ValueError, match="tier must be one of"):
        idx.add(h[0], "gpu")
    with pytest.raises(ValueError, match="needs the worker's instance id"):
        idx.add(h[0], "t0")


def test_salt_isolation_tenant_b_misses_tenant_a_hits():
    idx = PrefixIndex(clock=Clock())
    prompt = list(range(100, 132))
    a, b = chain("tenant-a", prompt), chain("tenant-b", prompt)
    idx.apply(BlockStored(a, None, 4, "cpu"))
    assert idx.lookup(b) == {}  # same tokens, other tenant: nothing shared
    assert idx.lookup(chain("tenant-a", prompt)) == {("cpu", ""): 8}  # A's repeat hits in full


def test_lru_victims_follow_last_use_and_skip_pins():
    clock = Clock()
    idx = PrefixIndex(clock=clock)
    h = chain("", list(range(20)))  # 5 blocks
    for x in h:
        clock.now += 1
        idx.add(x, "cpu")
    idx.touch(h[0], "cpu")
    assert idx.lru_order("cpu") == [h[1], h[2], h[3], h[4], h[0]]
    pin = idx.pin([h[1], h[3]], ttl_s=10)
    assert list(idx.victims("cpu")) == [h[2], h[4], h[0]]  # pinned blocks are never victims
    assert idx.unpin(pin) is True
    assert idx.unpin(pin) is False  # idempotent release
    assert list(idx.victims("cpu")) == [h[1], h[2], h[3], h[4], h[0]]


def test_expired_pin_is_reclaimed():
    clock = Clock()
    idx = PrefixIndex(clock=clock)
    h = chain("", list(range(8)))
    idx.add(h[0], "cpu")
    idx.add(h[1], "cpu")
    pin = idx.pin([h[0]], ttl_s=5)
    assert list(idx.victims("cpu")) == [h[1]] and idx.active_pins == 1
    clock.now += 5
    assert list(idx.victims("cpu")) == [h[0], h[1]]  # the walk reclaimed the expired pin
    assert (idx.active_pins, idx.reclaimed_pins) == (0, 1)
    assert idx.unpin(pin) is False
    with pytest.raises(ValueError, match="cannot pin unknown block"):
        idx.pin([b"\x00" * 16], 1)
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        idx.pin([h[0]], 0)


def test_pinned_block_outlives_its_last_location():
    idx = PrefixIndex(clock=Clock())
    h = chain("", list(range(4)))
    idx.add(h[0], "ssd")
    pin = idx.pin(h, 10)
    idx.remove(h[0], "ssd")
    assert idx.entry(h[0]) is not None and idx.pinned(h[0]) and idx.lookup(h) == {}
    idx.unpin(pin)
    assert idx.entry(h[0]) is None


def test_block_hashes_are_what_the_bus_contract_says():
    """docs/architecture.md (InstanceInfo) spells the hashes out for tools that compute them:
    this is that text, written again with hashlib and struct, against llmbus.kv.hashing."""
    import hashlib
    import struct

    def spelled(model: str, kv_format: str, salt: str, tokens: list[int], bs: int) -> list[bytes]:
        root = hashlib.blake2b(digest_size=16, person=b"llmbus-root")
        for part in (model, kv_format, salt):
            root.update(struct.pack("<I", len(part.encode())) + part.encode())
        out, parent = [], root.digest()
        for start in range(0, len(tokens) - bs + 1, bs):
            block = struct.pack(f"<{bs}I", *tokens[start:start + bs])
            parent = hashlib.blake2b(parent + block, digest_size=16, person=b"llmbus-block").digest()
            out.append(parent)
        return out

    tokens = [0, 1, 70000, 2**32 - 1, 5, 6, 7, 8, 9, 10]  # two full blocks of 4 and a partial one
    assert chain_hashes(root_hash("llama-0123456789abcdef", "int8", "tenant-é"), tokens, 4) == \
        spelled("llama-0123456789abcdef", "int8", "tenant-é", tokens, 4)
    assert len(chain_hashes(root_hash("m", "model"), tokens, 4)) == 2
