"""Triton paged decode attention vs reference.paged_decode_attention_cache (TRITON_INTERPRET=1 on CPU)."""

import dataclasses
import os

import pytest
import torch

from llmbus.kernels import quant_reference as qr  # noqa: E402
from llmbus.kernels import reference as ref  # noqa: E402
from llmbus.kernels.kv_cache import PagedKVCache, allocate_cache  # noqa: E402
from llmbus.kernels.paged_decode import int4_lanes, int8_words, paged_decode_attention  # noqa: E402
from llmbus.kv.formats import KVFormat  # noqa: E402
from llmbus.kv.layout import KVLayout  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}


def _fill(cache, lay, lens, num_blocks, seed):
    """Random K/V for sequences of ``lens`` tokens on shuffled blocks; returns int32 block tables."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(1, max(lay.num_blocks_for(n) for n in lens))
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):
        blocks = [perm.pop() for _ in range(lay.num_blocks_for(n))]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        if n:
            k = torch.randn(n, lay.num_kv_heads, lay.head_dim, generator=g) + 0.5
            v = torch.randn(n, lay.num_kv_heads, lay.head_dim, generator=g)
            sm = torch.tensor(lay.slot_mapping(blocks, 0, n), device=DEV)
            ref.write_kv_cache(k.to(DEV, cache.model_dtype), v.to(DEV, cache.model_dtype), cache, sm)
    return tables.to(DEV)


def _check(name, dtype, hkv, group, head_dim, bs, lens, splits, seed=0, tile=None, scale_dtype="float16", num_warps=None,
           heads_first=True, head_major=False, **launch):
    lay = KVLayout(num_layers=1, num_kv_heads=hkv, head_dim=head_dim, block_size=bs, dtype=dtype)
    nblocks = sum(lay.num_blocks_for(n) for n in lens) + 3
    cache = allocate_cache(KVFormat(name, scale_dtype=scale_dtype), lay, nblocks, DEV, head_major=head_major)
    tables = _fill(cache, lay, lens, nblocks, seed)
    q = torch.randn(len(lens), hkv * group, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(DEV, cache.model_dtype)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    want = ref.paged_decode_attention_cache(q, cache, tables, sl, head_dim**-0.5)
    got = paged_decode_attention(q, cache, tables, sl, head_dim**-0.5, num_splits=splits, tile=tile, num_warps=num_warps,
                                 heads_first=heads_first, **launch)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    empty = [i for i, n in enumerate(lens) if n == 0]
    assert (got[empty] == 0).all()
    return cache


@pytest.mark.parametrize("name", ["model", "int8", "int4", "int4r"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_decode_dtypes_and_formats(name, dtype):
    _check(name, dtype, hkv=2, group=4, head_dim=32, bs=16, lens=[37, 1, 0, 16], splits=1)


@pytest.mark.parametrize("name", ["model", "int8", "int4", "int4r"])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_decode_head_major_storage(name, head_dim):
    """A cache stored head-major (allocate_cache(head_major=True): one head's rows of a block
    contiguous) decodes as the token-major one, through the fast loops from 64 channels (INT8's
    scales, read in pairs, are dense though not contiguous)."""
    cache = _check(name, "float16", hkv=2, group=4, head_dim=head_dim, bs=16, lens=[37, 1, 0, 48], splits=2,
                   tile=32, head_major=True)
    assert cache.data.stride(3) > cache.data.stride(2)  # heads outside tokens
    assert int8_words(cache) == (name == "int8" and head_dim >= 64)
    assert int4_lanes(cache) == (name.startswith("int4") and head_dim >= 64)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_gqa_ratios_and_split_k(group, splits):
    _check("int4", "bfloat16", hkv=2, group=group, head_dim=16, bs=16, lens=[53, 7, 0], splits=splits, seed=group)


@pytest.mark.parametrize("name", ["model", "int8", "int4", "int4r"])
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_grid_in_either_order(name, splits):
    """The grid's programs in KV-head-first order (the default) or sequence-first give the same
    attention, each program finding its own sequence, head and split."""
    for heads_first in (True, False):
        _check(name, "bfloat16", hkv=3, group=2, head_dim=64, bs=16, lens=[70, 0, 33, 1], splits=splits, seed=splits,
               tile=32, heads_first=heads_first)


@pytest.mark.parametrize("bs,head_dim", [(32, 64), (16, 128)])
def test_decode_block_sizes_and_head_dims(bs, head_dim):
    _check("int4", "float16", hkv=1, group=2, head_dim=head_dim, bs=bs, lens=[45, 33, 1], splits=2)
    _check("int8", "bfloat16", hkv=1, group=2, head_dim=head_dim, bs=bs, lens=[45, 2], splits=1)


@pytest.mark.parametrize("name", ["int8", "int4", "int4r"])
@pytest.mark.parametrize("tile,splits", [(32, 1), (64, 2)])
def test_decode_multi_block_tiles(name, tile, splits):
    """Tiles of several blocks (the CUDA default): INT4's per-block key ranges broadcast per block,
    tiles that straddle the last full block, the partial tail in the split that holds it."""
    _check(name, "bfloat16", hkv=2, group=4, head_dim=32, bs=16, lens=[100, 64, 17, 5], splits=splits, tile=tile)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_int8_words_gqa_ratios_and_split_k(group, splits):
    """From 64 channels INT8 decode reads 32-bit words split into four channel classes."""
    _check("int8", "bfloat16", hkv=2, group=group, head_dim=64, bs=16, lens=[53, 7, 0, 1, 32], splits=splits, seed=group)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_decode_int8_words_dtypes_and_wide_tiles(dtype):
    """The warps sharing each tile's softmax (decode_tiles.int8_words_loop; the per-warp loop's
    tests: test_decode_warp_tiles)."""
    _check("int8", dtype, hkv=1, group=4, head_dim=128, bs=32, lens=[100, 64, 17], splits=2, tile=64, warp_tiles=False)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_decode_int8_fp32_scales(head_dim):
    """INT8 with fp32 scales, byte-wise (32 channels) and word-wise (64): scales load as they are."""
    _check("int8", "bfloat16", hkv=2, group=4, head_dim=head_dim, bs=16, lens=[70, 1, 33], splits=2, seed=9,
           scale_dtype="float32")


def _shifted(cache, field: str) -> PagedKVCache:
    """A copy of ``cache`` whose ``field`` tensor starts one element past a 4-byte boundary."""
    t = getattr(cache, field)
    raw = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    moved = raw[1:].view(t.shape)
    moved.copy_(t)
    return dataclasses.replace(cache, **{field: moved})


@pytest.mark.parametrize("name,field,uses_fast_path", [("int8", "data", int8_words), ("int8", "scale", int8_words),
                                                       ("int4", "data", int4_lanes), ("int4", "k_meta", int4_lanes),
                                                       ("int4", "v_meta", int4_lanes), ("int4r", "data", int4_lanes),
                                                       ("int4r", "k_meta", int4_lanes), ("int4r", "v_meta", int4_lanes)])
def test_decode_fast_paths_need_aligned_caches(name, field, uses_fast_path):
    """INT8 codes (read as words), INT4 codes (read as 16-bit lanes) or 16-bit metadata (INT8 scales,
    INT4 ranges: read in pairs) that start off their boundary take the generic path, with the same
    result."""
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype="float16")
    aligned = allocate_cache(KVFormat(name), lay, 4, DEV)
    tables = _fill(aligned, lay, [53], 4, seed=5)
    shifted = _shifted(aligned, field)
    assert uses_fast_path(aligned) and not uses_fast_path(shifted)
    q = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(6)).half().to(DEV)
    sl = torch.tensor([53], dtype=torch.int32, device=DEV)
    want = ref.paged_decode_attention_cache(q, aligned, tables, sl, 0.125)
    for cache in (aligned, shifted):
        torch.testing.assert_close(paged_decode_attention(q, cache, tables, sl, 0.125), want, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("name", ["int4", "int4r"])
@pytest.mark.parametrize("group,splits", [(1, 1), (4, 3), (8, 2)])
def test_decode_int4_lanes_at_head_dim_128(name, group, splits):
    """INT4 (and INT4R: decode_tiles.int4_tokens_loop, the warps sharing each tile's softmax) full
    blocks by channel class at the real models' head_dim, with multi-block tiles, the partial tail
    block after them, and empty and one-token sequences."""
    _check(name, "bfloat16", hkv=2, group=group, head_dim=128, bs=16, lens=[150, 48, 0, 1, 33], splits=splits,
           seed=group, tile=64, warp_tiles=False)


@pytest.mark.parametrize("name", ["int4", "int4r"])
@pytest.mark.parametrize("head_dim,bs", [(64, 16), (128, 32), (256, 16)])
def test_decode_int4_lanes_shapes_at_the_cuda_tile(name, head_dim, bs):
    """The lane loops at the CUDA default tile (64) for their narrowest head (64 channels: class dots
    of 16), two-block tiles of 32-token blocks, and (INT4) four value groups per token (256 channels)."""
    _check(name, "float16", hkv=2, group=4, head_dim=head_dim, bs=bs, lens=[130, 64, 31, 1], splits=2, seed=head_dim,
           tile=64)


@pytest.mark.parametrize("name", ["int4r", "int8"])
@pytest.mark.parametrize("group,head_dim,splits", [(1, 64, 1), (4, 128, 3), (6, 64, 2), (8, 64, 2), (16, 64, 2)])
@pytest.mark.parametrize("tile,num_warps", [(64, 4), (128, 4), (64, 2), (256, 4)])
def test_decode_warp_tiles(name, group, head_dim, splits, tile, num_warps):
    """INT4R's and INT8's loops with a softmax a warp (decode_tiles.int4_tokens_warp_loop,
    int8_words_warp_loop): each warp's share of every tile (16 tokens and up), tokens down the dots'
    rows, its state merged with the others' at the end, the partial block after it; GQA ratios
    (the query rows the dots' columns: one, a group under a mma's 8, 6 padded to 8, 8, 16), split-K,
    empty and one-token sequences."""
    from llmbus.kernels.paged_decode import decode_launch

    cache = _check(name, "bfloat16", hkv=2, group=group, head_dim=head_dim, bs=16, lens=[150, 48, 0, 1, 33],
                   splits=splits, seed=group + tile, tile=tile, num_warps=num_warps, warp_tiles=True)
    q = torch.zeros(1, 2 * group, head_dim, dtype=torch.bfloat16, device=DEV)
    one = torch.ones(1, dtype=torch.int32, device=DEV)
    launch = decode_launch(q, cache, one[:, None], one, tile=tile, num_warps=num_warps, warp_tiles=True)
    rows = 1 << (group - 1).bit_length()
    assert launch.meta["WARP_TILES"] and launch.meta["GP"] == rows  # a power of two, not 16
    # a warp's share under 16 tokens (what a dot needs natively) takes the shared loop, rows padded
    shared = decode_launch(q, cache, one[:, None], one, tile=32, num_warps=4, warp_tiles=True).meta
    assert not shared["WARP_TILES"] and shared["GP"] == max(16, rows)


@pytest.mark.parametrize("group,head_dim,bs,splits", [(1, 64, 16, 1), (2, 128, 16, 2), (4, 128, 16, 3), (6, 64, 32, 2),
                                                   (8, 128, 32, 2), (16, 64, 16, 2)])
@pytest.mark.parametrize("tile,num_warps", [(64, 2), (64, 4), (32, 2)])
def test_decode_int4_blocks_loop(group, head_dim, bs, splits, tile, num_warps):
    """INT4's loop with a softmax per block slot (decode_tiles.int4_blocks_warp_loop): each block's
    per-channel key ranges scaling its own copy of the queries, one or two value groups a token
    (head_dim 64, 128), 16- and 32-token blocks, tiles of one slot a warp, two, and one for two
    warps, the slots' states merged at the end and the partial block after them; GQA ratios
    (query rows the dots' columns, padded to a power of two, at least INT4_MIN_ROWS: one row went
    wrong natively on the H200), split-K, empty and one-token sequences."""
    from llmbus.kernels.paged_decode import INT4_MIN_ROWS, decode_launch

    cache = _check("int4", "bfloat16", hkv=2, group=group, head_dim=head_dim, bs=bs, lens=[150, 2 * bs, 0, 1, 33],
                   splits=splits, seed=group + tile, tile=tile, num_warps=num_warps, warp_tiles=True)
    q = torch.zeros(1, 2 * group, head_dim, dtype=torch.bfloat16, device=DEV)
    one = torch.ones(1, dtype=torch.int32, device=DEV)
    meta = decode_launch(q, cache, one[:, None], one, tile=tile, num_warps=num_warps, warp_tiles=True).meta
    assert meta["WARP_TILES"] and meta["GP"] == max(INT4_MIN_ROWS, 1 << (group - 1).bit_length())


def test_decode_int4_blocks_loop_only_for_one_or_two_value_groups(monkeypatch):
    """Four value groups a token (head_dim 256) keep the lane loop, at its own launch; the block
    loop's launch (CUDA_LAUNCH) is uncapped, the lane loop's (SHARED_LAUNCH) capped."""
    from llmbus.kernels import paged_decode
    from llmbus.kernels.paged_decode import CUDA_LAUNCH, SHARED_LAUNCH, decode_launch, int4_blocks, launch_defaults, register_cap

    one = torch.ones(1, dtype=torch.int32, device=DEV)
    for d, blocks in ((64, True), (128, True), (256, False)):
        lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=d, block_size=16, dtype="bfloat16")
        cache = allocate_cache(KVFormat("int4"), lay, 2, DEV)
        assert int4_lanes(cache) and int4_blocks(cache) == blocks
        q = torch.zeros(1, 8, d, dtype=torch.bfloat16, device=DEV)
        assert decode_launch(q, cache, one[:, None], one, tile=64, num_warps=2).meta["WARP_TILES"] == (
            blocks and paged_decode.WARP_TILES)
        monkeypatch.setattr(paged_decode, "WARP_TILES", True)
        assert launch_defaults("int4", None, cache) == (CUDA_LAUNCH if blocks else SHARED_LAUNCH)["int4"]
        assert register_cap(cache) == (0 if blocks else SHARED_LAUNCH["int4"][3])
        monkeypatch.undo()
    _check("int4", "float16", hkv=2, group=4, head_dim=256, bs=16, lens=[70, 1], splits=1, seed=5, tile=64,
           num_warps=2, warp_tiles=True)


@pytest.mark.parametrize("name", ["int4r", "int8", "int4"])
def test_decodes_through_the_per_warp_loops_by_default(name, monkeypatch):
    """INT4R's and INT8's CUDA launches (CUDA_LAUNCH) give each warp 16 tokens or more of a tile, so
    the per-warp loops serve them by default (paged_decode.WARP_TILES), a group of 6 padded to 8
    rows, at the launch's register cap; turned off, the shared loops run at their own launches
    (SHARED_LAUNCH), rows padded to 16."""
    from llmbus.kernels import paged_decode
    from llmbus.kernels.paged_decode import CUDA_LAUNCH, SHARED_LAUNCH, decode_launch, launch_defaults, register_cap

    if "LLMBUS_TRITON_WARP_TILES" not in os.environ:
        assert paged_decode.WARP_TILES
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    cache = allocate_cache(KVFormat(name), lay, 2, DEV)
    q = torch.zeros(1, 12, 64, dtype=torch.bfloat16, device=DEV)
    one = torch.ones(1, dtype=torch.int32, device=DEV)
    for on, (tile, warps, _, regs) in ((True, CUDA_LAUNCH[name]), (False, SHARED_LAUNCH[name])):
        monkeypatch.setattr(paged_decode, "WARP_TILES", on)
        assert launch_defaults(name) == launch_defaults(name, on) == (CUDA_LAUNCH if on else SHARED_LAUNCH)[name]
        assert register_cap(cache) == regs and register_cap(cache, 0) == 0
        # off CUDA the launch defaults to one block a tile, so the CUDA launch's tile and warps are passed
        meta = decode_launch(q, cache, one[:, None], one, tile=tile, num_warps=warps).meta
        assert meta["WARP_TILES"] == on and meta["GP"] == (8 if on else 16), meta
    assert CUDA_LAUNCH[name][0] // CUDA_LAUNCH[name][1] >= 16


@pytest.mark.parametrize("bs,tile,num_warps", [(16, 128, 4), (16, 64, 2), (16, 128, 8), (16, 32, 2), (16, 64, 8),
                                               (32, 128, 2), (8, 64, 4)])
def test_decode_int4_lanes_rows_in_warp_order(bs, tile, num_warps):
    """The lane loop orders a tile's tokens so that each warp's score columns are whole blocks
    (decode_tiles.warp_rows): one block a warp, two, other block sizes, and, where a warp's share
    is less than a block, the plain order; two KV heads, so rows are found per head too."""
    _check("int4", "bfloat16", hkv=2, group=4, head_dim=64, bs=bs, lens=[300, 130, 64, 17], splits=2, seed=tile,
           tile=tile, num_warps=num_warps, warp_tiles=False)


def test_pipeline_stages_keep_buffered_tiles_within_budget():
    """The pipeliner buffers ``stages - 1`` tiles of codes: launches whose tiles would pass the
    budget get fewer stages, never under two (one buffer)."""
    from llmbus.kernels.paged_decode import STAGE_BUDGET, pipeline_stages

    def cache(name, d):
        return allocate_cache(KVFormat(name), KVLayout(num_layers=1, num_kv_heads=2, head_dim=d, block_size=16,
                                                       dtype="bfloat16"), 2, DEV)

    assert pipeline_stages(cache("int8", 128), 128, 3) == 3 and pipeline_stages(cache("int4", 128), 64, None) == 3
    assert pipeline_stages(cache("int8", 256), 256, 3) == 2  # 2 x 128 KB of codes would pass 160 KB
    assert pipeline_stages(cache("int8", 256), 128, 4) == 3 and pipeline_stages(cache("model", 256), 256, 3) == 2
    assert 2 * 128 * 2 * 256 <= STAGE_BUDGET < 2 * 256 * 2 * 256


def test_decode_grid_order_defaults_heads_first_within_cuda_limits(monkeypatch):
    """KV heads first unless asked otherwise (argument or module default), and never for a batch
    that would overflow the grid's second dimension."""
    from llmbus.kernels import paged_decode

    assert paged_decode.grid_order(8) and not paged_decode.grid_order(8, heads_first=False)
    assert not paged_decode.grid_order(paged_decode.MAX_GRID_Y + 1)
    monkeypatch.setattr(paged_decode, "HEADS_FIRST", False)
    assert not paged_decode.grid_order(8) and paged_decode.grid_order(8, heads_first=True)


def test_resident_programs_by_registers_threads_and_shared_memory():
    """Programs an SM holds: registers per warp in units of 8 a thread, a KB of shared memory
    reserved per program, 32 programs at most; 0 when one does not fit."""
    from llmbus.kernels.paged_decode import HOPPER_SM, resident_programs

    assert resident_programs(128, 4, 75_800, HOPPER_SM) == 3  # shared memory binds: INT8's default launch
    assert resident_programs(128, 4, 30_000, HOPPER_SM) == 4  # registers bind
    assert resident_programs(121, 4, 30_000, HOPPER_SM) == 4 and resident_programs(129, 4, 0, HOPPER_SM) == 3
    assert resident_programs(32, 16, 0, HOPPER_SM) == 4  # threads bind
    assert resident_programs(16, 1, 0, HOPPER_SM) == 32
    assert resident_programs(32, 4, 300_000, HOPPER_SM) == 0


def test_split_count_fills_the_device_then_avoids_thin_last_waves(monkeypatch):
    """Small grids split to fill the device twice over (as many splits as tiles at most); past
    that, a grid whose last wave would be thin splits further, into the fewest splits within 5% of
    the best time, every split (the last included) of at least MIN_SPLIT_TILES tiles. Never more
    than the fill where that is no faster (timed in whole tiles a split)."""
    from llmbus.kernels import paged_decode
    from llmbus.kernels.paged_decode import grid_time, split_count

    assert split_count(8, 512, 132, 4) == 33 and split_count(8, 5, 132, 4) == 5  # the fill: 264 programs
    assert split_count(128, 256, 132, 4) == 3
    assert split_count(512, 64, 132, 4) == 1  # batch 64 x 8 heads: one wave where four programs fit an SM
    # where three fit (396 slots) the last of two waves would hold 116 programs, under one an SM
    assert grid_time(512, 396, 264) == 396 + 264 and grid_time(1024, 396, 264) == 2 * 396 + 264
    assert split_count(512, 64, 132, 3) == 2
    assert split_count(512, 7, 132, 3) == 1  # two splits: 4 tiles and a last of 3
    assert split_count(2048, 256, 132, 3) == 2
    assert split_count(512, 64, 132, 1) == 1  # the last of four waves still saturates: 116 of 132
    assert split_count(32, 46, 132, 2) == 9  # eight splits of 6 tiles in one wave beat any count past it
    assert split_count(1, 1, 132, 4) == 1 and split_count(10**6, 1024, 132, 4) == 1
    split_count.cache_clear()
    monkeypatch.setattr(paged_decode, "WAVE_SPLITS", False)
    assert split_count(512, 64, 132, 3) == 1 and split_count(8, 512, 132, 4) == 33
    split_count.cache_clear()


def test_decode_launch_off_cuda_takes_one_split_unless_asked():
    """Off CUDA the split count is 1 (none is chosen from a device); an explicit count sets SPLIT."""
    from llmbus.kernels.paged_decode import decode_launch

    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    cache = allocate_cache(KVFormat("int8"), lay, 8, DEV)
    q = torch.zeros(3, 8, 64, device=DEV)
    tables, lens = torch.zeros(3, 2, dtype=torch.int32, device=DEV), torch.full((3,), 20, dtype=torch.int32, device=DEV)
    launch = decode_launch(q, cache, tables, lens)
    if DEV == "cpu":
        assert launch.splits == 1 and launch.per_sm is None and not launch.meta["SPLIT"]
    else:
        assert launch.per_sm >= 1 and launch.meta["SPLIT"] == (launch.splits > 1)
    assert decode_launch(q, cache, tables, lens, num_splits=3).meta["SPLIT"]
    with pytest.raises(ValueError, match="block_tables and seq_lens must be int32"):
        decode_launch(q, cache, tables.long(), lens)


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode): result byte i is byte ``sel`` nibble i of the pair {b, a}."""
    assert all((sel >> 4 * i) & 8 == 0 for i in range(4)), "sign-replicate selectors are not emulated"
    pool = (b << 32 | a).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[(sel >> 4 * i) & 7] for i in range(4)), "little")


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX ``lop3.b32``: bit by bit, the ``lut`` entry indexed by (a, b, c) as in 0xF0 / 0xCC / 0xAA."""
    return sum(((lut >> ((a >> k & 1) << 2 | (b >> k & 1) << 1 | (c >> k & 1))) & 1) << k for k in range(32))


def _run_ptx(text: str, regs: dict) -> dict:
    """The PTX statements of ``text`` (an inline-asm block) run in order on ``regs`` (name -> 32-bit
    int), as the PTX ISA defines them: mov.b32, shr.b32, prmt.b32 (default mode), lop3.b32,
    sub.f16x2 and fma.rn.f16x2 (each half rounded once to fp16); anything else fails."""
    import re

    import numpy as np

    statements = [x.strip() for x in text.strip("{} ").split(";") if x.strip()]
    assert statements[0].startswith(".reg "), statements
    regs = dict(regs)
    for st in statements[1:]:
        op, args = st.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        val = [regs[a] if a in regs else int(a, 0) for a in src]
        if op == "mov.b32":
            regs[d] = val[0]
        elif op == "shr.b32":
            regs[d] = val[0] >> val[1]
        elif op == "prmt.b32":
            regs[d] = _prmt(*val)
        elif op == "lop3.b32":
            regs[d] = _lop3(*val)
        elif op in ("sub.f16x2", "fma.rn.f16x2"):
            halves = [_f16x2(v) for v in val]
            out = [x - y for x, y in zip(*halves)] if op == "sub.f16x2" else [x * y + z for x, y, z in zip(*halves)]
            regs[d] = int.from_bytes(np.array(out, np.float16).tobytes(), "little")
        else:
            raise AssertionError(f"not emulated: {st}")
        assert re.fullmatch(r"\$\d|\w+", d) and regs[d] >> 32 == 0, st
    return regs


@pytest.mark.parametrize("biased", [False, True])
def test_int8_pair_ptx_reads_the_right_bytes_and_values(biased):
    """What the GPU-only conversion (decode_tiles.S8_PAIR_*) computes, instruction by instruction as
    the PTX ISA defines them (``_run_ptx``), for every code in every byte of two words ($1, $2), with
    other codes around it that must not leak in: $0, the fp16 pair of the two words' codes
    (S8_BIASED_*: 1152 + code). It runs natively in the kernel tests on a GPU (scripts/gpu_check.sh)."""
    import numpy as np

    from llmbus.kernels import decode_tiles

    codes = np.arange(-127, 128, dtype=np.int8)
    names = [f"S8_{'BIASED' if biased else 'PAIR'}_{b}" for b in range(4)]
    for byte, ptx in enumerate(getattr(decode_tiles, n) for n in names):
        for lo_code, hi_code in zip(codes, codes[::-1]):
            b1, b2 = np.array([90, -17, 3, -128], np.int8), np.array([-90, 17, -3, 127], np.int8)
            b1[byte], b2[byte] = lo_code, hi_code
            w1, w2 = (int.from_bytes(b.tobytes(), "little") for b in (b1, b2))
            regs = _run_ptx(ptx.value, {"$0": 0, "$1": w1, "$2": w2})
            want = [float(lo_code), float(hi_code)]
            assert _f16x2(regs["$0"]) == ([1152.0 + x for x in want] if biased else want), (byte, lo_code, hi_code)


def _f16x2(word: int) -> list[float]:
    import numpy as np

    return np.frombuffer(word.to_bytes(4, "little"), np.float16).astype(float).tolist()


@pytest.mark.parametrize("biased", [False, True])
def test_int4_lanes_ptx_reads_the_right_nibbles_and_values(biased):
    """What the GPU-only conversion (decode_tiles.U4_LANES) computes, instruction by instruction as the
    PTX ISA defines them, for every byte value in every position of two 16-bit lanes with other bytes
    around it: output $r holds channel class r of both lanes (class 0, 1: the low byte's low and high
    nibble; 2, 3: the high byte's); U4_LANES_BIASED, the same as 1024 + code (classes 0, 2) and 1024 +
    16 code (1, 3)."""
    from llmbus.kernels import decode_tiles

    text = (decode_tiles.U4_LANES_BIASED if biased else decode_tiles.U4_LANES).value
    for byte in range(256):
        for pos in range(4):
            word = [0x5A, 0xC3, 0x0F, 0xF0]
            word[pos] = byte
            regs = _run_ptx(text, {"$4": int.from_bytes(bytes(word), "little")})
            lanes = (word[0] | word[1] << 8, word[2] | word[3] << 8)
            for r in range(4):
                want = [float(x >> 4 * r & 15) for x in lanes]
                if biased:
                    want = [1024.0 + (16 if r % 2 else 1) * c for c in want]
                assert _f16x2(regs[f"${r}"]) == want, (byte, pos, r)


def test_int4_bytes_ptx_splits_nibbles_by_channel_parity():
    """What the GPU-only split (decode_tiles.U4_BYTES) computes, instruction by instruction as the
    PTX ISA defines them, for every byte value in every position of a word: output $0 holds each
    byte's low nibble (its even channel's code), $1 its high nibble (the odd channel's), in place."""
    import re

    from llmbus.kernels import decode_tiles

    text = decode_tiles.U4_BYTES.value
    statements = [x.strip() for x in text.strip("{} ").split(";") if x.strip()]
    assert statements[0].startswith(".reg ") and all(x.startswith(("shr.b32", "and.b32")) for x in statements[1:])
    for byte in range(256):
        for pos in range(4):
            word = [0x5A, 0xC3, 0x0F, 0xF0]
            word[pos] = byte
            regs = {"$2": int.from_bytes(bytes(word), "little")}
            for op, args in re.findall(r"(shr\.b32|and\.b32) ([^;]+);", text):
                d, *src = [a.strip() for a in args.split(",")]
                a, b = [regs[x] if x in regs else int(x, 0) for x in src]
                regs[d] = a >> b if op == "shr.b32" else a & b
            assert list(regs["$0"].to_bytes(4, "little")) == [x & 15 for x in word], (byte, pos)
            assert list(regs["$1"].to_bytes(4, "little")) == [x >> 4 for x in word], (byte, pos)


def _tie_queries(shape, seed):
    """Queries (fp32) of multiples of 2.375 / 8, each row's largest exactly 2.375: a channel at +-1.1875 is
    a tie of the int8 rounding (63.5 steps), which ``x * (127 / 2.375)`` misses by an ulp (63.499996,
    rounding to 63, not 64)."""
    q = torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).float() * (2.375 / 8)
    q[..., 0] = 2.375
    return q


@pytest.mark.parametrize("head_dim,launch", [(32, {}), (64, {}), (64, dict(tile=32)),
                                             (64, dict(tile=64, num_warps=4, warp_tiles=True))])
def test_decode_int4r_rounds_queries_as_the_reference_ties_included(head_dim, launch):
    """INT4R attends with its queries rounded to int8 per row (quant_reference.round_query), through
    the fast loop (head_dim 64: whole tiles, and at tile 32 a masked last one; a softmax a warp) and
    the generic tile load (32): ties go half up in all."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype="float32")
    lens = [37, 16, 50]
    nblocks = sum(lay.num_blocks_for(n) for n in lens) + 3
    cache = allocate_cache(KVFormat("int4r"), lay, nblocks, DEV)
    tables = _fill(cache, lay, lens, nblocks, seed=5)
    q = _tie_queries((3, 8, head_dim), seed=6).to(DEV)
    assert ((q == 1.1875).sum() > 20) and int4_lanes(cache) == (head_dim == 64)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    want = ref.paged_decode_attention_cache(q, cache, tables, sl, 0.3)
    torch.testing.assert_close(paged_decode_attention(q, cache, tables, sl, 0.3, num_splits=2, **launch), want,
                               atol=TOL["float32"], rtol=TOL["float32"])
    # the rounding is the reference's: ties half up, and it shows in the output
    codes = (qr.round_query(q) * 127 / 2.375).round()
    assert (codes[q == 1.1875] == 64).all() and (codes[q == -1.1875] == -63).all()
    plain = ref.paged_decode_attention(q, ref.dequantized_context(cache, tables, sl)[0],
                                       ref.dequantized_context(cache, tables, sl)[1], sl, 0.3)
    assert (want - plain).abs().max() > 1e-4


@pytest.mark.parametrize("name,group,head_dim,lens,splits,tile,warp_tiles,num_warps", [
    ("int8", 4, 64, [64, 48, 0, 1, 17, 33], 1, 16, None, None),  # whole tiles only, whole + partial
    ("int8", 8, 128, [96, 5, 64], 16, 32, None, None),  # more splits than tiles: idle splits
    ("int8", 4, 64, [160, 130, 31, 0, 1], 3, 64, True, 2),  # a softmax a warp
    ("int8", 1, 128, [96, 5, 64, 200], 16, 64, True, 4),
    ("int4r", 4, 64, [128, 48, 0, 1, 17, 64], 1, 64, False, None),
    ("int4r", 8, 64, [160, 130, 31], 3, 64, True, 2),  # a softmax a warp
    ("int4r", 1, 128, [96, 5, 64, 200], 16, 64, True, 4),
    ("int4", 4, 64, [160, 130, 31, 0, 1], 3, 64, True, 2),  # a softmax a block
    ("int4", 1, 128, [96, 5, 64, 200], 16, 64, True, 4),
])
def test_decode_reads_nothing_past_a_sequence(name, group, head_dim, lens, splits, tile, warp_tiles, num_warps):
    """The fast loops read whole tiles unmasked and mask only a split's last: every byte no token
    owns holds NaN codes or metadata, and the tables point past each sequence's blocks at such a
    block, so one read past a sequence's end shows in the output."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype="bfloat16")
    nblocks = sum(lay.num_blocks_for(n) for n in lens) + 2
    cache = allocate_cache(KVFormat(name), lay, nblocks, DEV)
    assert int8_words(cache) if name == "int8" else int4_lanes(cache)
    cache.data.fill_(127 if name == "int8" else 255)
    for meta in (cache.scale, cache.k_meta, cache.v_meta):
        if meta is not None:  # NaN, or an fp16 NaN's bits where the metadata is stored as int16
            meta.fill_(float("nan") if meta.is_floating_point() else 0x7E00)
    g = torch.Generator().manual_seed(3)
    free = (torch.randperm(nblocks - 1, generator=g) + 1).tolist()  # block 0 stays poisoned
    tables = torch.zeros(len(lens), max(lay.num_blocks_for(n) for n in lens) + 2, dtype=torch.int32)
    for i, n in enumerate(lens):
        blocks = [free.pop() for _ in range(lay.num_blocks_for(n))]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        if n:
            k = torch.randn(n, 2, head_dim, generator=g) + 0.5
            v = torch.randn(n, 2, head_dim, generator=g)
            ref.write_kv_cache(k.to(DEV, torch.bfloat16), v.to(DEV, torch.bfloat16), cache,
                               torch.tensor(lay.slot_mapping(blocks, 0, n), device=DEV))
    q = torch.randn(len(lens), 2 * group, head_dim, generator=g).to(DEV, torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    tables = tables.to(DEV)
    want = ref.paged_decode_attention_cache(q, cache, tables, sl, head_dim**-0.5)
    got = paged_decode_attention(q, cache, tables, sl, head_dim**-0.5, num_splits=splits, tile=tile,
                                 warp_tiles=warp_tiles, num_warps=num_warps)
    assert not want.isnan().any() and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL["bfloat16"], rtol=TOL["bfloat16"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name,warp_tiles,num_warps", [("int4r", False, None), ("int4r", True, 2), ("int8", False, None),
                                                     ("int8", True, 2), ("int4", True, 2), ("int4", True, 4)])
def test_decode_biased_codes(monkeypatch, name, dtype, warp_tiles, num_warps):
    """The decode loops with their codes biased, as fp16 dots on CUDA take them: INT4R's values and
    INT4's keys and values (decode_tiles.lane_codes: 1024 + code, 1024 + 16 code; INT4's key bias
    off each block's scores), INT8's keys and values (word_codes:
    1152 + code), the bias taken off the scores (INT8's keys: 1152 * sum(q) a row) and off the sums
    at the end (values). Off CUDA the dots run in fp32, so the path is forced here
    (paged_decode.BIASED_VALUES)."""
    from llmbus.kernels import paged_decode

    monkeypatch.setattr(paged_decode, "BIASED_VALUES", True)
    cache = _check(name, dtype, hkv=2, group=4, head_dim=64, bs=16, lens=[130, 64, 31, 1, 0], splits=2, seed=7,
                   tile=64, warp_tiles=warp_tiles, num_warps=num_warps)
    q = torch.zeros(1, 8, 64, dtype=cache.model_dtype, device=DEV)
    one = torch.ones(1, dtype=torch.int32, device=DEV)
    meta = paged_decode.decode_launch(q, cache, one[:, None], one, tile=64, warp_tiles=warp_tiles,
                                      num_warps=num_warps).meta
    assert meta["BIASED"] and (meta["LANES"] or meta["WORDS"]) and meta["WARP_TILES"] == bool(warp_tiles)
    monkeypatch.setattr(paged_decode, "BIASED_VALUES", None)  # by default only fp16 dots (CUDA) take it
    assert paged_decode.decode_launch(q, cache, one[:, None], one, tile=64).meta["BIASED"] == (DEV == "cuda")


def test_decode_bad_tile_is_a_value_error():
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16)
    cache = allocate_cache(KVFormat("int4"), lay, 2, DEV)
    q = torch.randn(1, 1, 16, device=DEV)
    one = torch.ones(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="tile must be"):
        paged_decode_attention(q, cache, torch.zeros(1, 1, dtype=torch.int32, device=DEV), one, 1.0, tile=24)


def test_decode_more_splits_than_tiles_and_all_empty():
    _check("model", "float32", hkv=1, group=1, head_dim=16, bs=16, lens=[5, 0], splits=6)
    _check("int8", "float32", hkv=1, group=1, head_dim=16, bs=16, lens=[0, 0], splits=2)


def test_decode_high_block_ids_do_not_overflow_int32():
    """Blocks whose element offset exceeds 2**31 (cache is torch.empty: untouched pages are free)."""
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16, dtype="float16")
    n = (2**31) // (16 * 16) + 40
    try:
        data = torch.empty(2, n, 16, 1, 16, dtype=torch.int8, device=DEV)
        scale = torch.empty(2, n, 16, 1, dtype=torch.float16, device=DEV)
    except RuntimeError as exc:  # pragma: no cover
        pytest.skip(f"cannot reserve a {n}-block cache: {exc}")
    cache = PagedKVCache(KVFormat("int8"), lay, data, scale=scale)
    hi = [n - 1, n - 7, n - 20]
    k, v = torch.randn(40, 1, 16).half().to(DEV), torch.randn(40, 1, 16).half().to(DEV)
    ref.write_kv_cache(k, v, cache, torch.tensor(lay.slot_mapping(hi, 0, 40), device=DEV))
    tables = torch.tensor([hi], dtype=torch.int32, device=DEV)
    sl = torch.tensor([40], dtype=torch.int32, device=DEV)
    q = torch.randn(1, 2, 16).half().to(DEV)
    want = ref.paged_decode_attention_cache(q, cache, tables, sl, 0.25)
    torch.testing.assert_close(paged_decode_attention(q, cache, tables, sl, 0.25, num_splits=2), want, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("name", ["int4", "int4r"])
def test_decode_int4_lane_loops_high_block_ids_do_not_overflow_int32(name):
    """INT4's block loop and INT4R's per-warp loop index the codes as 16-bit lanes: blocks whose
    lane offset exceeds 2**31 (key codes past 4 GiB; the cache is torch.empty: untouched pages are
    free)."""
    from llmbus.kernels.paged_decode import decode_launch

    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype="float16")
    fmt = KVFormat(name)
    small = allocate_cache(fmt, lay, 1, DEV)
    n = 2**31 // (16 * 64 // 4) + 8  # a block's key codes: 256 lanes

    def empty(t, dim):
        return torch.empty(*t.shape[:dim], n, *t.shape[dim + 1:], dtype=t.dtype, device=DEV)

    try:
        cache = PagedKVCache(fmt, lay, empty(small.data, 1), k_meta=empty(small.k_meta, 0),
                             v_meta=empty(small.v_meta, 0))
    except RuntimeError as exc:  # pragma: no cover
        pytest.skip(f"cannot reserve a {n}-block cache: {exc}")
    hi = [n - 1, n - 5, n - 8]
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(48, 1, 64, generator=g).half().to(DEV) for _ in range(2))
    ref.write_kv_cache(k, v, cache, torch.tensor(lay.slot_mapping(hi, 0, 48), device=DEV))
    tables = torch.tensor([hi], dtype=torch.int32, device=DEV)
    sl = torch.tensor([48], dtype=torch.int32, device=DEV)
    q = torch.randn(1, 4, 64, generator=g).half().to(DEV)
    assert int4_lanes(cache) and decode_launch(q, cache, tables, sl, tile=64, num_warps=2, warp_tiles=True).meta["WARP_TILES"]
    want = ref.paged_decode_attention_cache(q, cache, tables, sl, 0.125)
    got = paged_decode_attention(q, cache, tables, sl, 0.125, num_splits=2, tile=64, num_warps=2, warp_tiles=True)
    torch.testing.assert_close(got, want, atol=3e-3, rtol=3e-3)


def test_decode_bad_input_is_a_value_error():
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, block_size=16)
    cache = allocate_cache(KVFormat("model"), lay, 2, DEV)
    q = torch.randn(1, 3, 16, device=DEV)
    with pytest.raises(ValueError, match="query must be"):
        paged_decode_attention(q, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)
    q = torch.randn(1, 2, 16, device=DEV)
    with pytest.raises(ValueError, match="must be int32"):
        paged_decode_attention(q, cache, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int32), 1.0)


@pytest.mark.parametrize("name,head_dim", [("int4", 32), ("int4r", 32), ("int4r", 64)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_reads_partial_int4_blocks_from_tail_rows(name, head_dim, dtype, splits):
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype)
    lens = [37, 5, 16, 50, 0]
    nblocks = sum(lay.num_blocks_for(n) for n in lens) + 3
    cache = allocate_cache(KVFormat(name), lay, nblocks, DEV, tail_rows=6)
    tables = _fill(cache, lay, lens, nblocks, seed=3)
    g = torch.Generator().manual_seed(4)
    # NOTE: rows holding keys the codes do not, so which one a kernel reads shows in its output
    for tail in (cache.k_tail, cache.v_tail):
        tail.copy_(torch.randn(tail.shape, generator=g).to(DEV, cache.model_dtype) * 2)
    rows = torch.tensor([4, 0, 2, -1, 1], dtype=torch.int32, device=DEV)  # seq 2 is full, seq 3 has none
    q = torch.randn(len(lens), 4, head_dim, generator=g).to(DEV, cache.model_dtype)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    want = ref.paged_decode_attention_cache(q, cache, tables, sl, 0.25, rows)
    got = paged_decode_attention(q, cache, tables, sl, 0.25, num_splits=splits, tail_rows=rows)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    plain = ref.paged_decode_attention_cache(q, cache, tables, sl, 0.25)
    assert ((want - plain).float().abs().amax(dim=(1, 2)) > 1e-2).tolist() == [True, True, False, False, False]
