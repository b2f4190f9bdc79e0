"""BlockManager: allocation, prefix cache, LRU eviction, rollback, salt isolation.

Tiny pools, 4-token blocks, exact block ids.
"""

from __future__ import annotations

import pytest

from llmbus.engine.block_manager import BlockManager
from llmbus.engine.sampling_params import SamplingParams
from llmbus.engine.sequence import Sequence

BS = 4


def make_seq(rid: str, tokens: list[int], salt: str = "") -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=list(tokens), params=SamplingParams(), cache_salt=salt)


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Allocate the whole uncached prompt, mark it computed, commit: what one prefill step does."""
    hit = bm.cached_prefix_tokens(seq)
    assert bm.allocate(seq, seq.num_tokens - hit)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def assert_all_free(bm: BlockManager) -> None:
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == [0] * bm.num_blocks
    assert bm.num_free_blocks == bm.num_blocks


def test_allocate_extend_and_free_counts():
    bm = BlockManager(10, BS)
    seq = make_seq("a", list(range(10)))
    assert bm.allocate(seq, 10)
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 7
    assert [bm.ref_count(b) for b in (0, 1, 2, 3)] == [1, 1, 1, 0]
    seq.num_computed_tokens = 10
    assert bm.allocate(seq, 2)  # positions 10, 11 still fit block 2
    assert seq.block_table == [0, 1, 2]
    assert bm.allocate(seq, 3)  # position 12 needs a fourth block
    assert seq.block_table == [0, 1, 2, 3]
    assert bm.num_free_blocks == 6
    bm.free(seq)
    assert seq.block_table == [] and seq.block_hashes == []
    assert_all_free(bm)
    bm.free(seq)  # idempotent
    assert_all_free(bm)


def test_prefix_reuse_shares_full_blocks():
    bm = BlockManager(10, BS)
    prompt = list(range(100, 110))  # two full blocks + 2 tokens
    a = make_seq("a", prompt)
    prefill(bm, a)
    assert len(a.block_hashes) == 2
    assert bm.num_cached_blocks == 2
    b = make_seq("b", prompt)
    assert bm.cached_prefix_tokens(b) == 8
    assert bm.allocate(b, 2)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert b.block_hashes == a.block_hashes
    assert [bm.ref_count(x) for x in a.block_table] == [2, 2, 1]
    assert bm.ref_count(b.block_table[2]) == 1
    assert bm.num_free_blocks == 10 - 4


def test_partial_block_is_not_shared():
    bm = BlockManager(10, BS)
    a = make_seq("a", [1, 2, 3, 4, 5, 6])
    prefill(bm, a)
    assert bm.num_cached_blocks == 1  # the 2-token tail block is not hashed
    b = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # same first 6 tokens
    assert bm.cached_prefix_tokens(b) == 4
    assert bm.allocate(b, 5)
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    assert bm.ref_count(a.block_table[1]) == 1


def test_hit_covering_every_token_leaves_the_last_block():
    bm = BlockManager(10, BS)
    prompt = list(range(8))  # exactly two blocks
    a = make_seq("a", prompt)
    prefill(bm, a)
    assert bm.num_cached_blocks == 2
    b = make_seq("b", prompt)
    assert bm.cached_prefix_tokens(b) == 4
    assert bm.allocate(b, 4)
    assert b.num_computed_tokens == 4
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    assert b.block_hashes == a.block_hashes[:1]


def test_lru_eviction_order_and_free_tail_first():
    bm = BlockManager(6, BS)
    a = make_seq("a", list(range(0, 8)))
    b = make_seq("b", list(range(50, 58)))
    prefill(bm, a)
    prefill(bm, b)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    bm.free(a)
    bm.free(b)
    # Evictable LRU, oldest first: 1, 0 (a, tail first), then 3, 2 (b); free list: 4, 5.
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    c = make_seq("c", list(range(200, 212)))
    assert bm.allocate(c, 12)
    assert c.block_table == [4, 5, 1]
    assert bm.num_cached_blocks == 3
    # a's first block survived its second one.
    assert bm.cached_prefix_tokens(make_seq("a2", list(range(0, 8)) + [9])) == 4
    d = make_seq("d", list(range(300, 308)))
    assert bm.allocate(d, 8)
    assert d.block_table == [0, 3]
    assert bm.num_cached_blocks == 1
    assert bm.cached_prefix_tokens(make_seq("b2", list(range(50, 58)) + [9])) == 4
    for s in (c, d):
        bm.free(s)
    assert_all_free(bm)


def test_prefix_hit_refreshes_lru_position():
    bm = BlockManager(3, BS)
    a = make_seq("a", list(range(0, 4)) + [99])
    b = make_seq("b", list(range(10, 14)) + [99])
    prefill(bm, a)
    assert a.block_table == [0, 1]
    bm.free(a)  # LRU: 0 ; free list: 2, 1 (the unhashed tail block)
    prefill(bm, b)
    assert b.block_table == [2, 1]
    bm.free(b)  # LRU: 0, 2 ; free list: 1
    a2 = make_seq("a2", list(range(0, 4)) + [7])
    assert bm.allocate(a2, 1)  # hit on block 0, the tail takes free block 1
    assert a2.block_table == [0, 1]
    bm.free(a2)  # LRU: 2, 0 -- block 0 is now the most recently used
    c = make_seq("c", list(range(20, 28)))
    assert bm.allocate(c, 8)
    assert c.block_table == [1, 2]  # the free block first, then the LRU victim b's block, not a's
    assert bm.cached_prefix_tokens(make_seq("a3", list(range(0, 4)) + [1])) == 4
    assert bm.cached_prefix_tokens(make_seq("b3", list(range(10, 14)) + [1])) == 0


def test_failed_allocation_rolls_back_completely():
    bm = BlockManager(4, BS)
    a = make_seq("a", list(range(8)))
    prefill(bm, a)
    bm.free(a)  # blocks 0, 1 evictable; 2, 3 free
    other = make_seq("o", [70, 71, 72])
    assert bm.allocate(other, 3)
    assert other.block_table == [2]
    c = make_seq("c", list(range(16)))  # hits 2 blocks, needs 2 more, only 1 left
    before = ([bm.ref_count(x) for x in range(4)], bm.num_free_blocks, bm.num_cached_blocks)
    assert bm.cached_prefix_tokens(c) == 8
    assert not bm.allocate(c, 8)
    assert c.block_table == [] and c.block_hashes == []
    assert c.num_computed_tokens == 0 and c.num_cached_tokens == 0
    assert ([bm.ref_count(x) for x in range(4)], bm.num_free_blocks, bm.num_cached_blocks) == before
    # The LRU is intact: the next single-block allocation takes free block 3, then a's tail block 1.
    d = make_seq("d", [90] * 8)
    assert bm.allocate(d, 8)
    assert d.block_table == [3, 1]
    bm.free(d)
    bm.free(other)
    assert_all_free(bm)


def test_salt_isolation_between_tenants():
    bm = BlockManager(12, BS)
    prompt = list(range(30, 40))
    a = make_seq("a", prompt, salt="tenant-a")
    prefill(bm, a)
    b = make_seq("b", prompt, salt="tenant-b")
    assert bm.cached_prefix_tokens(b) == 0
    prefill(bm, b)
    assert b.num_cached_tokens == 0
    assert not set(b.block_table) & set(a.block_table)
    assert b.block_hashes != a.block_hashes
    a2 = make_seq("a2", prompt, salt="tenant-a")
    assert bm.allocate(a2, 2)
    assert a2.num_cached_tokens == 8
    assert a2.block_table[:2] == a.block_table[:2]
    assert bm.num_cached_blocks == 4
    for s in (a, b, a2):
        bm.free(s)
    assert_all_free(bm)


def test_commit_of_duplicate_hashes_keeps_the_first_block():
    bm = BlockManager(7, BS)
    prompt = list(range(9))
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    assert bm.allocate(a, 9) and bm.allocate(b, 9)  # both miss: nothing committed yet
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    a.num_computed_tokens = b.num_computed_tokens = 9
    bm.commit(a)
    bm.commit(b)
    assert b.block_hashes == a.block_hashes and len(a.block_hashes) == 2
    assert bm.num_cached_blocks == 2
    c = make_seq("c", prompt)
    assert bm.allocate(c, 1)
    assert c.block_table == [0, 1, 6]  # a's indexed copies, not b's
    assert [bm.ref_count(x) for x in range(7)] == [2, 2, 1, 1, 1, 1, 1]
    bm.free(c)
    bm.free(b)  # b's copies are unindexed: back to the free list, not the LRU
    bm.free(a)  # a's tail block 2 -> free list; blocks 1, 0 -> LRU
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 7
    d = make_seq("d", [99] * 12)
    assert bm.allocate(d, 12)
    assert d.block_table == [6, 5, 4]  # the free list, in release order, before any cached block
    assert bm.cached_prefix_tokens(c) == 8
    bm.free(d)
    assert_all_free(bm)


def test_commit_is_incremental_and_follows_computed_tokens():
    bm = BlockManager(6, BS)
    seq = make_seq("s", list(range(10)))
    assert bm.allocate(seq, 6)
    seq.num_computed_tokens = 6
    bm.commit(seq)
    assert len(seq.block_hashes) == 1 and bm.num_cached_blocks == 1
    assert bm.allocate(seq, 4)
    seq.num_computed_tokens = 10
    bm.commit(seq)
    full = make_seq("ref", list(range(10)))
    prefill(BlockManager(6, BS), full)
    assert seq.block_hashes == full.block_hashes


def test_refcounts_return_to_zero_with_many_sharers():
    bm = BlockManager(8, BS)
    prompt = list(range(13))
    seqs = [make_seq(f"s{i}", prompt + [i]) for i in range(3)]
    for s in seqs:
        prefill(bm, s)
    assert [bm.ref_count(b) for b in seqs[0].block_table[:3]] == [3, 3, 3]
    assert bm.num_free_blocks == 8 - 3 - 3
    for s in seqs:
        bm.free(s)
    assert_all_free(bm)
    assert bm.num_cached_blocks == 3


def test_prefix_caching_disabled_never_shares():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a, b = make_seq("a", list(range(10))), make_seq("b", list(range(10)))
    prefill(bm, a)
    prefill(bm, b)
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_cached_blocks == 0 and b.num_cached_tokens == 0
    assert b.block_hashes == a.block_hashes  # hashes are still computed for the kv pool
    bm.free(a)
    bm.free(b)
    assert_all_free(bm)


def test_allocate_computed_for_a_handoff():
    bm = BlockManager(4, BS)
    seq = make_seq("h", list(range(9)))
    seq.output_token_ids.append(5)
    assert bm.allocate_computed(seq, 9)
    assert seq.block_table == [0, 1, 2] and seq.num_computed_tokens == 9
    bm.commit(seq)
    assert bm.num_cached_blocks == 2
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate_computed(seq, 9)
    big = make_seq("big", list(range(30)))
    assert not bm.allocate_computed(big, 20)
    assert big.block_table == [] and big.num_computed_tokens == 0
    bm.free(seq)
    assert_all_free(bm)


def test_bad_input_gives_clear_errors():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, BS)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    bm = BlockManager(4, BS)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate(make_seq("a", [1]), -1)
    with pytest.raises(ValueError, match="outside"):
        bm.ref_count(4)
    stale = make_seq("s", [1, 2, 3])
    stale.num_computed_tokens = 2
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.allocate(stale, 1)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        bm.allocate_computed(make_seq("x", [1, 2]), 2)


def test_evictions_of_computed_blocks_are_reported_with_their_parents_before_reuse():
    bm = BlockManager(4, BS)
    seen = []
    bm.on_evict = lambda block, h, parent: seen.append((block, h, parent))
    a = make_seq("a", list(range(12)))  # 3 full blocks
    prefill(bm, a)
    hashes = list(a.block_hashes)
    bm.free(a)
    assert seen == []  # freed blocks stay cached: nothing evicted yet
    b = make_seq("b", list(range(100, 112)))
    prefill(bm, b)  # takes the one free block, then evicts a's tail first
    assert [h for _, h, _ in seen] == [hashes[2], hashes[1]]
    assert [p for _, _, p in seen] == [hashes[1], hashes[0]]  # each block's chain parent
    assert all(bm.ref_count(block) == 1 for block, _, _ in seen)  # reported, then handed to b
    bm.free(b)
    imported = bm.import_cached([b"x" * 32, b"y" * 32])  # a lower tier's blocks, not written back
    seen.clear()
    c = make_seq("c", list(range(200, 216)))
    prefill(bm, c)  # needs all 4 blocks: evicts everything cached
    assert len(imported) == 2 and {h for _, h, _ in seen}.isdisjoint({b"x" * 32, b"y" * 32})
    assert len(seen) == 2  # b's two blocks the import left cached


def test_changes_record_what_the_cache_indexes_and_forgets_in_order():
    bm = BlockManager(4, BS, model_id="m")
    assert bm.changes is None  # off until someone drains it
    bm.track_changes()
    a = make_seq("a", list(range(9)))  # 2 full blocks, and a partial one never indexed
    prefill(bm, a)
    h0, h1 = a.block_hashes
    root = bm._root(a)  # noqa: SLF001
    assert list(bm.changes) == [(True, h0, root), (True, h1, h0)]
    bm.free(a)
    bm.changes.clear()
    imported = bm.import_cached([b"x" * 16, b"y" * 16], protect=[h0])  # two free blocks, nothing evicted
    assert len(imported) == 2 and list(bm.changes) == [(True, b"x" * 16, h0), (True, b"y" * 16, b"x" * 16)]
    bm.changes.clear()
    b = make_seq("b", list(range(100, 108)))
    prefill(bm, b)  # two blocks, both evicted from the LRU: a's tail goes before its head
    assert [(added, h) for added, h, _ in list(bm.changes)[:2]] == [(False, h1), (False, h0)]
    assert [added for added, _, _ in list(bm.changes)[2:]] == [True, True]


def test_changes_nobody_drains_are_capped():
    bm = BlockManager(2, BS)
    bm.track_changes()
    for i in range(20):
        s = make_seq(f"s{i}", list(range(i * 8, i * 8 + 8)))
        prefill(bm, s)
        bm.free(s)
    assert len(bm.changes) == 4 * bm.num_blocks
    assert bm.changes[-1][0] is True  # the newest kept
