"""Triton paged decode attention: one query token per sequence over its block table.

Grid ``(Hkv, B, SPLITS)`` (``(B, Hkv, SPLITS)`` with ``heads_first`` off: ``HEADS_FIRST``): a program
takes every query head of one KV head's group (so each KV tile is read once per group) and one
contiguous slice of the context (split-K). With one split
it writes the output; with several it writes unnormalized partials that ``reduce_splits``
combines. Scores use base-2 exponentials throughout (``m`` is in log2 units).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from llmbus.kernels.decode_tiles import (attend_tile, int4_blocks_warp_loop, int4_lanes_loop, int4_tokens_loop,
                                  int4_tokens_warp_loop, int8_tile, int8_words_loop, int8_words_warp_loop, tile_query)
from llmbus.kernels.kv_tile import dot_args, load_kv_tile, tile_args
from llmbus.kernels.reduce_splits import reduce_splits

LOG2E = 1.4426950408889634
# NOTE: LLMBUS_TRITON_ASM=0 swaps the inline-PTX code conversions for their plain Triton twins.
ASM = os.environ.get("LLMBUS_TRITON_ASM", "1") != "0"
# NOTE: in fp16 dots the decode loops take their codes biased, as the bit tricks make them: INT4R's
# values (decode_tiles.lane_codes, unbias: four instructions fewer a pair of lanes), INT8's keys and
# values (word_codes: one fewer a pair), for one more dot each (the tile's bias, off the sums as
# they grow) and a bias off INT8's scores.
# LLMBUS_TRITON_BIASED_VALUES=0 turns that off; =1 turns it on in any dot dtype but bf16 (which
# cannot hold 1024 + code), fp32 off CUDA included (what the CPU tests force; in fp32 INT4R's bias
# costs ~1e-4 of a value's scale, which fp32 tolerances see). None: fp16 dots only.
BIASED_VALUES = {"0": False, "1": True}.get(os.environ.get("LLMBUS_TRITON_BIASED_VALUES", ""))
# (tile, num_warps, num_stages, max registers per thread, 0: no cap) on CUDA. Measured on an H200
# (Triton 3.6; 2026-12-04, docs/benchmarks.md): at 256 sequences x 32,768 tokens over head-major
# caches (backends.head_major), bf16 95% of peak bandwidth, int8 90%, int4r 89%, int4 48%. No
# other launch of the sweep (scripts/bench_gpu.py --sweep, token-major) beat these by more than 9%.
# model: 64-token tiles, 4 warps. int8 and int4r: their per-warp loops (WARP_TILES) at 64-token
# tiles and two warps, 32 tokens a warp; int8 capped at 168 registers (at 128 it spills in its
# loop: 19% slower), int4r at 128 (127 used: 16 warps an SM). int4: its loop with a softmax per
# block slot (decode_tiles.int4_blocks_warp_loop), uncapped (252 registers, 8 warps an SM; capped
# at 192 it was 16% slower).
CUDA_LAUNCH = {"model": (64, 4, 3, 0), "int8": (64, 2, 3, 168), "int4": (64, 2, 3, 0), "int4r": (64, 2, 3, 128)}
# The shared loops' launches, where the per-warp loops are off (WARP_TILES): INT8's best measured
# (72% of peak, 2026-11-30), INT4R's default before the per-warp loops, INT4's lane loop's best
# measured (29%, 2026-11-30).
SHARED_LAUNCH = {"int8": (128, 4, 3, 128), "int4r": (128, 4, 3, 128), "int4": (64, 4, 3, 128)}
# What the pipelined tiles of codes may take of a program's shared memory (227 KB on Hopper): a
# launch that would take more gets fewer stages (``pipeline_stages``).
STAGE_BUDGET = 160 * 1024
# NOTE: the grid's first dimension varies fastest, so programs launched together (and running together)
# are its neighbours there. With the KV heads first, those read the same blocks' rows: a token-major
# cache interleaves heads within a token's row (``[.., BS, H, D]``; on CUDA caches are head-major
# since 2026-12-04, backends.head_major, which leaves a block's heads apart), so one head's slice is a short run
# (64 bytes for INT4 at head_dim 128) and its neighbours' slices fill the rest of the same DRAM
# page and L2 lines at about the same time, where sequences first spread the reads of one moment
# over B blocks' pages. On the H200 (2026-12-04, token-major) heads first was 1-5% faster (INT4R
# 17% at 64 x 8,192); bench_gpu's sweep measures both orders.
# LLMBUS_TRITON_HEADS_FIRST=0 launches sequences first by default.
HEADS_FIRST = os.environ.get("LLMBUS_TRITON_HEADS_FIRST", "1") != "0"
# NOTE: INT4R and INT8 decode run their per-warp loops (decode_tiles.int4_tokens_warp_loop,
# int8_words_warp_loop: each warp its own softmax over its share of a tile, tokens down the dots'
# rows) where a warp's share is at least 16 tokens: no cross-warp reduction or weights through
# shared memory in the loop, and a group of 4 query heads pads its dots' columns to 8, not its rows
# to 16 (scripts/kernel_cost.py under the H200's Triton 3.6). On the H200 (2026-12-04), against the
# shared loops' best launches: INT8 3-7% faster, INT4R 19% at 64 x 8,192 and even at 256 x 32,768;
# bench_gpu's sweep times the shared loops beside them.
# INT4's full blocks (head_dim 64 or 128: one or two value groups) take a loop with a softmax per
# block slot of the tile (decode_tiles.int4_blocks_warp_loop): its per-channel key ranges scale a
# copy of the queries a block, not the codes.
# LLMBUS_TRITON_WARP_TILES=0 turns them off: decode then runs the shared loops (int4_tokens_loop,
# int8_words_loop, int4_lanes_loop) at their own launches (SHARED_LAUNCH).
WARP_TILES = os.environ.get("LLMBUS_TRITON_WARP_TILES", "1") != "0"
INT4_MIN_ROWS = 4  # the query rows INT4's block loop pads a KV head's group to (paged_decode_attention)
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (the first goes to 2**31 - 1)


def grid_order(batch: int, heads_first: bool | None = None) -> bool:
    """Whether a decode launch of ``batch`` sequences takes its grid KV heads first: ``heads_first``,
    else ``HEADS_FIRST`` as it is now; never when the batch would not fit the grid's second dimension."""
    return (HEADS_FIRST if heads_first is None else heads_first) and batch <= MAX_GRID_Y


# NOTE: s_tb, the block tables' width, grows with the batch's longest context: not specialized,
# so eager steps do not compile new variants as it crosses multiples of 16 (it indexes one row)
@triton.jit(do_not_specialize=["s_tb"])
def paged_decode_kernel(
    q_ptr,  # [B, Hq, D]
    out_ptr,  # [B, Hq, D] (not SPLIT) or fp32 [B, Hq, S, D] partial accumulators (SPLIT)
    ml_ptr,  # fp32 [B, Hq, S, 2]: running max (log2 units) and denominator (SPLIT)
    data_ptr, scale_ptr, kmeta_ptr, vmeta_ptr, tail_ptr, vtail_ptr,  # the cache (see kv_tile.load_kv_tile)
    trows_ptr,  # [B] int32 (HAS_TAIL): each sequence's tail row, -1: none
    table_ptr,  # [B, M] int32
    seq_lens_ptr,  # [B] int32
    sm_scale,
    s_qb, s_qh, s_ob, s_oh, s_os, s_tb,
    s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh, s_tt, s_th,
    G: tl.constexpr, GP: tl.constexpr, TILE: tl.constexpr, TAIL: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, DQ: tl.constexpr,
    FMT: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, GV: tl.constexpr, GK: tl.constexpr, HAS_TAIL: tl.constexpr,
    WORDS: tl.constexpr,  # INT8 read as 32-bit words (decode_tiles.int8_words_loop)
    ASM: tl.constexpr,  # inline PTX conversions (CUDA only)
    BIASED: tl.constexpr,  # codes biased (BIASED_VALUES)
    LANES: tl.constexpr,  # INT4 / INT4R full blocks read as 16-bit lanes (decode_tiles.int4_lanes_loop, int4_tokens_loop)
    NW: tl.constexpr,  # the launch's num_warps
    WARP_TILES: tl.constexpr,  # INT4R, INT8 words, INT4 lanes: the per-warp loops (decode_tiles.*_warp_loop)
    HEADS_FIRST: tl.constexpr,  # grid (Hkv, B, SPLITS), not (B, Hkv, SPLITS)
):
    if HEADS_FIRST:
        h = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        h = tl.program_id(1)
    sid = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    trow = tl.full([], -1, tl.int32)
    if HAS_TAIL:
        trow = tl.load(trows_ptr + b)
    g = tl.arange(0, GP)
    c = tl.arange(0, D)
    heads = h * G + g
    gmask = g < G
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh + c[None, :], mask=gmask[:, None], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634
    # NOTE: INT4R attends with its queries rounded to int8, whole-tile loads too
    q, tile_scale = tile_query(q, qk_scale, FMT, DOT)
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    # NOTE: each sequence splits its own length (not the batch's longest) over the grid's splits,
    # in whole tiles: a grid sized for a longer bound (a recorded CUDA graph's) leaves the rest idle
    split_len = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), TILE) * TILE
    start = sid * split_len
    end = tl.minimum(seq_len, start + split_len)
    table = table_ptr + b.to(tl.int64) * s_tb
    # NOTE: unscaled steps pass m_i as the unused ks / vs operands.
    if FMT == 0:
        for s in range(start, end, TILE):
            pos = s + tl.arange(0, TILE)
            k, v = load_kv_tile(
                data_ptr, scale_ptr, kmeta_ptr, vmeta_ptr, table, pos, seq_len, h,
                s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
                tail_ptr, vtail_ptr, trow, s_tt, s_th, FMT, D, BS, GV, GK,
            )
            m_i, l_i, acc = attend_tile(q, k, v, pos < seq_len, m_i, m_i, m_i, l_i, acc, qk_scale, False, DOT, PREC)
    elif WORDS and WARP_TILES:
        m_i, l_i, acc = int8_words_warp_loop(
            q_ptr + b.to(tl.int64) * s_qb, heads * s_qh, gmask, data_ptr, scale_ptr, table, h, start, end,
            m_i, l_i, qk_scale, s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, GP, TILE, D, BS, DOT, PREC, ASM, BIASED,
            NW,
        )
    elif WORDS:
        m_i, l_i, acc = int8_words_loop(
            q_ptr + b.to(tl.int64) * s_qb, heads * s_qh, gmask, heads, data_ptr, scale_ptr, table, h, start, end,
            m_i, l_i, qk_scale, s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, GP, TILE, D, BS, DOT, PREC, ASM, False,
            BIASED,
        )
    elif FMT == 1:
        for s in range(start, end, TILE):
            pos = s + tl.arange(0, TILE)
            valid = pos < end
            kq, vq, ks, vs = int8_tile(data_ptr, scale_ptr, table, pos, valid, h,
                                       s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, D, BS)
            m_i, l_i, acc = attend_tile(q, kq, vq, valid, ks, vs, m_i, l_i, acc, qk_scale, True, DOT, PREC)
    else:
        # NOTE: split boundaries are multiples of TILE (so of BS): the partial tail block, if any,
        # lies in exactly one split, which handles it after its full blocks.
        full_end = (seq_len // BS) * BS
        lim = tl.minimum(end, full_end)
        if LANES and FMT == 3:
            if WARP_TILES:
                m_i, l_i, acc = int4_tokens_warp_loop(
                    q_ptr + b.to(tl.int64) * s_qb, heads * s_qh, gmask, data_ptr, kmeta_ptr, vmeta_ptr, table,
                    h, start, lim, m_i, l_i, qk_scale, s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
                    GP, TILE, D, BS, DOT, PREC, ASM, BIASED, NW,
                )
            else:
                m_i, l_i, acc = int4_tokens_loop(
                    q_ptr + b.to(tl.int64) * s_qb, heads * s_qh, gmask, heads, data_ptr, kmeta_ptr, vmeta_ptr, table,
                    h, start, lim, m_i, l_i, qk_scale, s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
                    GP, TILE, D, BS, DOT, PREC, ASM, False, BIASED,
                )
        elif LANES and WARP_TILES:
            m_i, l_i, acc = int4_blocks_warp_loop(
                q_ptr + b.to(tl.int64) * s_qb, heads * s_qh, gmask, data_ptr, kmeta_ptr, vmeta_ptr, table, h,
                start, lim, m_i, l_i, qk_scale, s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
                GP, TILE, D, BS, GV, DOT, PREC, ASM, BIASED,
            )
        elif LANES:
            m_i, l_i, acc = int4_lanes_loop(
                q_ptr + b.to(tl.int64) * s_qb, heads * s_qh, gmask, heads, data_ptr, kmeta_ptr, vmeta_ptr, table, h,
                start, lim, m_i, l_i, qk_scale, s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
                GP, TILE, D, BS, GV, DOT, PREC, DQ, ASM, False, NW,
            )
        else:
            # NOTE: below 64 channels (or on unaligned caches) the generic load serves: class tiles
            # would be narrower than a dot takes (16), and packed [.., D/2] tiles of 8 bytes gave
            # wrong results natively on the H200 (triton 3.6; right under the interpreter), where
            # the generic load (the prefill kernel's) is right at D=16.
            for s in range(start, lim, TILE):
                pos = s + tl.arange(0, TILE)
                k, v = load_kv_tile(
                    data_ptr, scale_ptr, kmeta_ptr, vmeta_ptr, table, pos, seq_len, h,
                    s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
                    tail_ptr, vtail_ptr, trow, s_tt, s_th, FMT, D, BS, GV, GK,
                )
                m_i, l_i, acc = attend_tile(q, k, v, pos < lim, m_i, m_i, m_i, l_i, acc, tile_scale, False, DOT, PREC)
        if (full_end < end) & (full_end >= start):
            pos = full_end + tl.arange(0, TAIL)
            k, v = load_kv_tile(
                data_ptr, scale_ptr, kmeta_ptr, vmeta_ptr, table, pos, seq_len, h,
                s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
                tail_ptr, vtail_ptr, trow, s_tt, s_th, FMT, D, BS, GV, GK,
            )
            m_i, l_i, acc = attend_tile(q, k, v, pos < seq_len, m_i, m_i, m_i, l_i, acc, tile_scale, False, DOT, PREC)
    if not SPLIT:
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o = out_ptr + b.to(tl.int64) * s_ob + heads[:, None] * s_oh + c[None, :]
        tl.store(o, res.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        row = b.to(tl.int64) * s_ob + heads * s_oh + sid * s_os
        tl.store(out_ptr + row[:, None] + c[None, :], acc, mask=gmask[:, None])
        ml = ((b.to(tl.int64) * (s_ob // D) + heads * (s_oh // D) + sid) * 2)
        tl.store(ml_ptr + ml, m_i, mask=gmask)
        tl.store(ml_ptr + ml + 1, l_i, mask=gmask)


def _dense(t: torch.Tensor) -> bool:
    """``t``'s elements fill its span of memory: no gaps, no overlaps (any order of dimensions)."""
    span = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride != span:
            return False
        span *= size
    return True


def _aligned(t: torch.Tensor, size: int, dims: int) -> bool:
    """``t`` starts on a ``size``-byte boundary and its first ``dims`` strides step whole multiples of
    ``size`` bytes (what reading it as ``size``-byte words needs)."""
    return t.data_ptr() % size == 0 and all(st * t.element_size() % size == 0 for st in t.stride()[:dims])


def int8_words(cache) -> bool:
    """Whether INT8 decode reads the cache as 32-bit words: from 64 channels (each class's dots
    need 16), on a word-aligned cache whose fp16 scales are word-aligned and dense too (they are
    read in pairs, decode_tiles.scale_at: a scale's neighbour in memory must lie in the tensor,
    which then holds an even count, 2 x N x bs x H)."""
    scale = cache.scale
    return (cache.fmt.name == "int8" and cache.layout.head_dim >= 64 and _aligned(cache.data, 4, 4)
            and (scale.dtype != torch.float16 or (_aligned(scale, 4, 0) and _dense(scale))))


def int4_lanes(cache) -> bool:
    """Whether INT4 (or INT4R) decode reads full blocks as 16-bit lanes of four channels: from 64
    channels (each class's dots need 16), on a cache whose codes are 2-byte aligned and whose
    ``k_meta`` and ``v_meta`` are word-aligned (their 16-bit fields are read in pairs)."""
    if not cache.fmt.int4_codes or cache.layout.head_dim < 64:
        return False
    vm = cache.v_meta.view(torch.int16)
    return (_aligned(cache.data, 2, 4) and _aligned(cache.k_meta, 4, 2) and _aligned(vm, 4, 4)
            and vm.stride(4) == 1 and vm.stride(3) == 2)


def int4_blocks(cache) -> bool:
    """Whether INT4 decode can run its loop with a softmax per block (``decode_tiles.int4_blocks_warp_loop``):
    lanes (``int4_lanes``) of one or two value groups a token (head_dim 64 or 128)."""
    lay = cache.layout
    return cache.fmt.name == "int4" and int4_lanes(cache) and lay.head_dim // cache.fmt.value_group(lay.head_dim) <= 2


def has_warp_loop(cache, meta: dict) -> bool:
    """Whether decode has a loop with a softmax per warp (INT4R, INT8 words: each warp's share of a
    tile, 16 tokens or more) or per block slot (``int4_blocks``) for the launch ``meta``."""
    if cache.fmt.name == "int4":
        return int4_blocks(cache)
    return ((cache.fmt.name == "int4r" and meta["LANES"]) or meta["WORDS"]) and meta["TILE"] // meta["NW"] >= 16


def launch_defaults(fmt: str, warp_tiles: bool | None = None, cache=None) -> tuple[int, int, int, int]:
    """A format's CUDA launch (tile, warps, stages, register cap): ``CUDA_LAUNCH``, or the shared
    loops' own (``SHARED_LAUNCH``) where the per-warp loops are off (``warp_tiles``, None:
    ``WARP_TILES``) or, for INT4, where ``cache`` (if given) cannot take its block loop."""
    off = not (WARP_TILES if warp_tiles is None else warp_tiles)
    if fmt in SHARED_LAUNCH and (off or (fmt == "int4" and cache is not None and not int4_blocks(cache))):
        return SHARED_LAUNCH[fmt]
    return CUDA_LAUNCH[fmt]


def register_cap(cache, max_registers: int | None = None, warp_tiles: bool | None = None) -> int:
    """The CUDA launch's registers per thread (0: no cap): ``max_registers``, else the format's
    default (``launch_defaults``) where its fast loop runs. INT4's cap is for its lane loop: on the
    generic one (head_dim 16) it raised the registers used, from 72 to 114."""
    if max_registers is not None:
        return max_registers
    fast = not cache.fmt.int4_codes or int4_lanes(cache)
    return launch_defaults(cache.fmt.name, warp_tiles, cache)[3] if fast else 0


def code_args(cache, query: torch.Tensor) -> dict:
    """The attention kernels' constexprs for reading ``cache``'s codes: the fast loops that serve it
    (WORDS, LANES), inline PTX (ASM), and the dot and dequantization dtypes (DOT, DQ)."""
    args = dict(dot_args(query), DQ=tl.float32, WORDS=int8_words(cache), LANES=int4_lanes(cache),
                ASM=query.is_cuda and ASM)
    if query.is_cuda and cache.fmt.quantized and query.dtype in (torch.float16, torch.bfloat16):
        # NOTE: quantized codes become fp16 exactly (decode_tiles.codes_f16), so the dots run in fp16
        # whatever the model dtype: no per-element conversion to bf16. Values the generic tile load
        # dequantizes round to fp16 too (three more bits than bf16 keeps; KV never nears its range).
        args.update(DOT=tl.float16, DQ=tl.float16)
    dot = args["DOT"]
    args["BIASED"] = dot == tl.float16 if BIASED_VALUES is None else BIASED_VALUES and dot != tl.bfloat16
    return args


def pipeline_stages(cache, tile: int, stages: int | None) -> int:
    """``stages`` (None: Triton's default, 3), fewer where the ``stages - 1`` tiles of codes the
    pipeliner buffers (keys and values of one KV head) would pass ``STAGE_BUDGET``; never below 2
    (one buffer), so a tile too large for even one still fails as before."""
    stages = stages or 3
    per_tile = tile * 2 * cache.data.shape[-1] * cache.data.element_size()  # a row: one head's codes
    while stages > 2 and (stages - 1) * per_tile > STAGE_BUDGET:
        stages -= 1
    return stages


def tile_size(cache, tile: int | None, cuda: bool, cuda_default: int) -> int:
    """KV positions an attention tile spans: ``tile``, else ``cuda_default`` on CUDA (at least a
    block; for INT4 at least two) and one block elsewhere; ValueError unless a power-of-two
    multiple of the block size (and, INT4 on CUDA, two blocks or more)."""
    bs = cache.layout.block_size
    int4 = cuda and cache.fmt.int4_codes
    tile = tile or (max(bs * (2 if int4 else 1), cuda_default) if cuda else bs)
    if tile % bs or tile & (tile - 1):
        raise ValueError(f"tile must be a power-of-two multiple of block_size {bs}, got {tile}")
    if int4 and tile < 2 * bs:
        # NOTE: one-block INT4 tiles decoded wrongly on an H200 under Triton 3.6 (max error 2.8
        # where two-block tiles and the interpreter are exact); cause not found yet.
        raise ValueError(f"{cache.fmt.name} attention on CUDA needs tile >= 2 * block_size ({2 * bs}), got {tile}")
    return tile


class SMLimits(NamedTuple):
    """What one streaming multiprocessor holds at once: 32-bit registers, threads, shared-memory bytes."""

    regs: int
    threads: int
    smem: int


HOPPER_SM = SMLimits(65536, 2048, 228 * 1024)
MAX_PROGRAMS_PER_SM = 32  # CUDA's resident blocks per SM (Volta to Hopper)
# NOTE: programs an SM needs running for its share of the memory bandwidth: the long-standing
# premise of choose_splits (fill the device twice over), not a measured constant.
SATURATING_PER_SM = 2
# Splits past the fill's count (choose_splits' wave rule) take at least this many tiles each: a split
# writes partials that the reduction reads back, and below this that traffic is no longer small.
MIN_SPLIT_TILES = 4
# NOTE: LLMBUS_TRITON_WAVE_SPLITS=0 keeps decode's split count at the fill (split_count), as before
# 2026-12-01: the wave rule rests on SATURATING_PER_SM. On the H200 (2026-12-04) the default launches
# took one split at the sweep's shapes (64 x 8,192, 256 x 32,768) either way, so the rule is still
# unmeasured where it differs (bench_gpu's sweep times the default launch in one split beside it)
WAVE_SPLITS = os.environ.get("LLMBUS_TRITON_WAVE_SPLITS", "1") != "0"


def resident_programs(regs: int, warps: int, smem: int, sm: SMLimits) -> int:
    """Programs of a launch (``regs`` registers a thread, ``warps`` warps, ``smem`` bytes of shared
    memory each) one SM holds at once: registers are allocated per warp in units of 8 a thread, and
    the driver reserves 1 KB of shared memory per program. 0: none fits."""
    per_warp = -(-regs // 8) * 8 * 32
    return min(sm.regs // (per_warp * warps), sm.threads // (32 * warps), sm.smem // (smem + 1024), MAX_PROGRAMS_PER_SM)


@functools.lru_cache(maxsize=None)
def _device_sms(index: int) -> tuple[int, SMLimits]:
    p = torch.cuda.get_device_properties(index)
    # NOTE: not every torch build exposes every limit (regs_per_multiprocessor is recent): Hopper's stand in
    return p.multi_processor_count, SMLimits(*(getattr(p, name, dflt) for name, dflt in zip(
        ("regs_per_multiprocessor", "max_threads_per_multi_processor", "shared_memory_per_multiprocessor"), HOPPER_SM)))


def grid_time(programs: int, slots: int, saturating: int) -> int:
    """How long a grid of ``programs`` equal programs runs, ``slots`` of them resident at once, in
    program-lengths times ``slots``: it runs in waves, each full wave one program-length, and a
    last, partial wave of ``r`` programs ``max(r, saturating) / slots`` of one (fewer than
    ``saturating`` programs do not draw the device's bandwidth: they take as long as that many)."""
    full, tail = divmod(programs, slots)
    return full * slots + (max(tail, saturating) if tail else 0)


@functools.lru_cache(maxsize=4096)
def split_count(programs: int, chunks: int, sms: int, per_sm: int) -> int:
    """Splits of each program's context for a decode grid of ``programs`` (sequences x KV heads), the
    longest context ``chunks`` tiles long, on ``sms`` SMs that each hold ``per_sm`` of its programs.

    At least enough that the grid fills the device about twice over (``SATURATING_PER_SM``), as
    many as the context has tiles and 64 at most: the fill. Past it (``WAVE_SPLITS``), and only
    where the fill's grid runs more than 5% over the ideal time, the fewest splits within 5% of the
    shortest ``grid_time``: programs with equal contexts finish together, so a grid of 1.3 waves
    (512 programs where 396 fit: INT8's default launch at batch 64 on an H200) takes about as long
    as 1.7 (its last wave, under one program an SM, does not draw the bandwidth), and in two
    splits it takes 1.33 (the ideal: 1.29). A split is whole tiles (the kernel's: ``ceil(chunks / splits)`` each, the last what
    is left), and an extra split count is one whose every split, the last included, takes at least
    ``MIN_SPLIT_TILES`` tiles."""
    cap = max(1, min(chunks, 64))
    fill = min(cap, max(1, -(-SATURATING_PER_SM * sms // max(1, programs))))
    slots = sms * max(1, per_sm)
    saturating = min(slots, SATURATING_PER_SM * sms)

    def run(splits: int) -> int:  # in tiles x slots, as grid_time
        length = -(-chunks // splits)
        return length * grid_time(programs * -(-chunks // length), slots, saturating)

    if not WAVE_SPLITS or programs * chunks >= 0.95 * run(fill):
        return fill
    counts = [fill] + [s for s in range(fill + 1, cap + 1)
                       if chunks - (s - 1) * -(-chunks // s) >= MIN_SPLIT_TILES]
    times = {s: run(s) for s in counts}
    best = min(times.values())
    return next(s for s in counts if times[s] * 0.95 <= best)


def choose_splits(batch: int, kv_heads: int, max_len: int, tile: int, device: torch.device, per_sm: int = 1) -> int:
    """``split_count`` on ``device`` (1 off CUDA), ``per_sm`` programs resident on each SM."""
    if device.type != "cuda":
        return 1
    sms, _ = _device_sms(device.index if device.index is not None else torch.cuda.current_device())
    return split_count(batch * kv_heads, max(1, -(-max_len // tile)), sms, per_sm)


_PER_SM: dict[tuple, int] = {}


def programs_per_sm(kernel, device: torch.device) -> int:
    """Programs of a compiled Triton ``kernel`` one SM of ``device`` holds (at least 1)."""
    # NOTE: a compiled kernel learns its register count when its binary loads (_init_handles, the
    # first launch's; Triton 3.6 and 3.9 alike), so a kernel only compiled loads it here
    kernel._init_handles()
    _, sm = _device_sms(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, resident_programs(kernel.n_regs, kernel.metadata.num_warps, kernel.metadata.shared, sm))


class DecodeLaunch(NamedTuple):
    """How ``paged_decode_attention`` launches: its grid's splits, the kernel's constexprs and
    launch options, and (CUDA, splits chosen) the programs an SM holds, which chose them."""

    splits: int
    meta: dict
    per_sm: int | None
    ptrs: tuple  # kv_tile.tile_args'
    strides: tuple


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    cache,  # llmbus.kernels.kv_cache.PagedKVCache
    block_tables: torch.Tensor,  # [B, M] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    **options,  # decode_launch's: num_splits, max_seq_len, tile, num_warps, num_stages, max_registers, tail_rows,
    # heads_first, warp_tiles
) -> torch.Tensor:  # [B, Hq, D]
    """Triton twin of ``reference.paged_decode_attention_cache``, launched as ``decode_launch`` says."""
    out_dtype = query.dtype
    if cache.fmt.name == "model" and query.dtype != cache.data.dtype:
        query = query.to(cache.data.dtype)
    if query.stride(-1) != 1:  # NOTE: the kernels take row and head strides (q is a view of qkv)
        query = query.contiguous()
    launch = decode_launch(query, cache, block_tables, seq_lens, **options)
    b, hq, d = query.shape
    hkv = cache.layout.num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if b == 0:
        return out.to(out_dtype)
    grid = _grid(launch, b, hkv)
    if launch.splits == 1:
        paged_decode_kernel[grid](*_single_args(query, out, launch, block_tables, seq_lens, scale), **launch.meta)
        return out.to(out_dtype)
    part = torch.empty(b, hq, launch.splits, d, dtype=torch.float32, device=query.device)
    ml = torch.empty(b, hq, launch.splits, 2, dtype=torch.float32, device=query.device)
    paged_decode_kernel[grid](
        query, part, ml, *launch.ptrs, block_tables, seq_lens, scale,
        query.stride(0), query.stride(1), part.stride(0), part.stride(1), part.stride(2), block_tables.stride(0),
        *launch.strides, **launch.meta,
    )
    reduce_splits(part, ml, out)
    return out.to(out_dtype)


def _grid(launch: DecodeLaunch, batch: int, kv_heads: int) -> tuple[int, int, int]:
    first, second = (kv_heads, batch) if launch.meta["HEADS_FIRST"] else (batch, kv_heads)
    return first, second, launch.splits


def _single_args(query, out, launch: DecodeLaunch, block_tables, seq_lens, scale) -> tuple:
    """The kernel's arguments for one split writing ``out``."""
    return (query, out, out, *launch.ptrs, block_tables, seq_lens, scale,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), 0, block_tables.stride(0), *launch.strides)


def single_split_kernel(query: torch.Tensor, launch: DecodeLaunch, block_tables: torch.Tensor, seq_lens: torch.Tensor):
    """``launch``'s single-split variant of the kernel, compiled (now, if it was not yet), not launched."""
    meta = {**launch.meta, "SPLIT": False}
    return paged_decode_kernel.warmup(*_single_args(query, query, launch, block_tables, seq_lens, 1.0), grid=(1,), **meta)


def decode_launch(
    query: torch.Tensor,
    cache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_registers: int | None = None,
    tail_rows: torch.Tensor | None = None,
    heads_first: bool | None = None,
    warp_tiles: bool | None = None,
) -> DecodeLaunch:
    """How ``paged_decode_attention`` launches (``query`` as it launches it: contiguous rows, the
    cache's dtype for model-dtype caches); ValueError on arguments it cannot take.

    ``num_splits`` None picks split-K from the device and the launch (``choose_splits``): that needs
    the programs an SM holds, so the single-split variant is compiled (if it is not yet) to read its
    registers and shared memory, once per variant and device. ``max_seq_len`` (else read from
    ``seq_lens``, a device-to-host read) bounds the split count; each sequence splits its own length
    over them, in whole tiles. ``tile`` (tokens per loop step, a multiple of block_size),
    ``num_warps``, ``num_stages`` and ``max_registers`` (per thread, 0: no cap) override the
    per-format launch defaults (``launch_defaults`` on CUDA, one block elsewhere). ``tail_rows`` ([B]
    int32) gives INT4 / INT4R sequences their tail rows (-1: none). ``heads_first`` (None: ``HEADS_FIRST``)
    orders the grid's programs KV head first (``grid_order``). ``warp_tiles`` (None: ``WARP_TILES``)
    gives INT4R's and INT8's warps a softmax each (``decode_tiles.int4_tokens_warp_loop``,
    ``int8_words_warp_loop``) where each warp's share of a tile is 16 tokens or more, and INT4's
    block slots one each (``int4_blocks_warp_loop``, ``has_warp_loop``); their query rows are then
    padded to a power of two, not to 16 (``GP``). Off, the launch defaults are the shared loops'
    (``SHARED_LAUNCH``)."""
    ptrs, strides, consts = tile_args(cache, tail_rows)
    b, hq, d = query.shape
    hkv = cache.layout.num_kv_heads
    if d != cache.layout.head_dim or hq % hkv:
        raise ValueError(f"query must be [B, k*{hkv}, {cache.layout.head_dim}], got {list(query.shape)}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"block_tables and seq_lens must be int32, got {block_tables.dtype} and {seq_lens.dtype}")
    if block_tables.shape[0] != b or seq_lens.shape != (b,) or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be [B, M] with contiguous rows and seq_lens [B]")
    cuda_tile, cuda_warps, cuda_stages, _ = launch_defaults(cache.fmt.name, warp_tiles, cache)
    tile = tile_size(cache, tile, query.is_cuda, cuda_tile)
    if query.is_cuda:
        num_warps, num_stages = num_warps or cuda_warps, pipeline_stages(cache, tile, num_stages or cuda_stages)
    grp = hq // hkv
    meta = dict(G=grp, GP=max(16, triton.next_power_of_2(grp)), TILE=tile, TAIL=max(16, cache.layout.block_size),
                SPLIT=False, **code_args(cache, query), **consts)
    meta.update({k: n for k, n in (("num_warps", num_warps), ("num_stages", num_stages)) if n})
    meta["NW"] = num_warps or 4  # Triton's default
    meta["WARP_TILES"] = has_warp_loop(cache, meta) and (WARP_TILES if warp_tiles is None else warp_tiles)
    if meta["WARP_TILES"]:  # its query rows are the dots' columns, of which a mma takes 8, not 16
        # NOTE: INT4's block loop at one query row a KV head (no GQA) gave wrong scores on the H200
        # (Triton 3.6, max error 3.3; 2026-12-04), right under the interpreter: padded to 4 rows,
        # checked there at groups of 1, 2, 4 and 8 (scripts/bench_gpu.py)
        meta["GP"] = max(INT4_MIN_ROWS if cache.fmt.name == "int4" else 1, triton.next_power_of_2(grp))
    meta["HEADS_FIRST"] = grid_order(b, heads_first)
    if query.is_cuda and (regs := register_cap(cache, max_registers, warp_tiles)):
        meta["maxnreg"] = regs
    launch = DecodeLaunch(num_splits or 1, meta, None, ptrs, strides)
    if num_splits is None and query.device.type == "cuda" and b:
        key = (query.device, query.dtype, *(t.dtype for t in ptrs), *meta.items())
        if (per_sm := _PER_SM.get(key)) is None:
            kernel = single_split_kernel(query, launch, block_tables, seq_lens)
            per_sm = _PER_SM[key] = programs_per_sm(kernel, query.device)
        max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        launch = launch._replace(splits=choose_splits(b, hkv, max_len, tile, query.device, per_sm), per_sm=per_sm)
    if launch.splits > 1:
        launch = launch._replace(meta={**meta, "SPLIT": True})
    return launch
