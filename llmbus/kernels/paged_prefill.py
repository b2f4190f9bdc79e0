"""Triton paged prefill attention: variable-length query chunks over a paged prefix.

Grid ``(cdiv(max_q_len, BLOCK_M), B, Hq)``. Query row ``j`` of sequence ``i`` sits at position
``seq_lens[i] - q_len_i + j`` and attends to every cached position up to its own: the whole
prefix, causally within the chunk. The chunk's own keys must already be written to the cache;
given the chunk's keys and values as computed (EXACT, quantized caches), the rows read the prefix
from the cache and their own chunk from those (``reference.exact_chunks``).
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from llmbus.kernels.decode_tiles import int4_lanes_loop, int4_tokens_loop, int8_words_loop, tile_query
from llmbus.kernels.kv_tile import load_kv_tile, softmax_step, tile_args
from llmbus.kernels.paged_decode import code_args, pipeline_stages, tile_size


@triton.jit
def generic_tile(s, end, q, qpos, m_i, l_i, acc, qk_scale, cache_args, TILE: tl.constexpr, DOT: tl.constexpr,
                 PREC: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, GV: tl.constexpr,
                 GK: tl.constexpr):
    """One online-softmax step of the rows (``q``, positions ``qpos``) over positions ``[s, s + TILE)``
    below ``end`` through the generic tile load (any format); ``cache_args`` as
    ``kv_tile.load_kv_tile`` takes them after ``pos``."""
    (data_ptr, scale_ptr, kmeta_ptr, vmeta_ptr, table, seq_len, h, s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh,
     s_kmn, s_kmh, s_vmn, s_vmb, s_vmh, tail_ptr, vtail_ptr, trow, s_tt, s_th) = cache_args
    pos = s + tl.arange(0, TILE)
    k, v = load_kv_tile(
        data_ptr, scale_ptr, kmeta_ptr, vmeta_ptr, table, pos, seq_len, h,
        s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
        tail_ptr, vtail_ptr, trow, s_tt, s_th, FMT, D, BS, GV, GK,
    )
    return causal_step(q, k, v, pos, end, qpos, m_i, l_i, acc, qk_scale, DOT, PREC)


@triton.jit
def chunk_tile(s, end, start, q, qpos, m_i, l_i, acc, qk_scale, key_ptr, value_ptr, strides, h,
               TILE: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, D: tl.constexpr):
    """``generic_tile``'s step over positions ``[s, s + TILE)`` below ``end`` of the rows' own chunk,
    read from the chunk's keys and values as computed: position ``p`` is row ``start + p`` of
    ``key_ptr`` / ``value_ptr`` (``strides``: their rows' and heads')."""
    s_kt, s_kh, s_vt, s_vh = strides
    pos = s + tl.arange(0, TILE)
    row = (start + pos).to(tl.int64)[:, None]
    valid = (pos < end)[:, None]
    c = tl.arange(0, D)[None, :]
    k = tl.load(key_ptr + row * s_kt + h * s_kh + c, mask=valid, other=0.0)
    v = tl.load(value_ptr + row * s_vt + h * s_vh + c, mask=valid, other=0.0)
    return causal_step(q, k, v, pos, end, qpos, m_i, l_i, acc, qk_scale, DOT, PREC)


@triton.jit
def causal_step(q, k, v, pos, end, qpos, m_i, l_i, acc, qk_scale, DOT: tl.constexpr, PREC: tl.constexpr):
    """The rows' online-softmax step over keys and values ``[TILE, D]`` at positions ``pos``: each row
    attends to those below ``end`` and up to its own position ``qpos``."""
    scores = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PREC) * qk_scale  # [BLOCK_M, TILE]
    allowed = (pos[None, :] <= qpos[:, None]) & (pos < end)[None, :]
    m_new, alpha, p, l_i = softmax_step(tl.where(allowed, scores, float("-inf")), m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PREC)
    return m_new, l_i, acc


# NOTE: as paged_decode_kernel's, s_tb unspecialized; and in a step mixing decodes with prompts
# the tables, lengths, query starts and tail rows come in as views past the decodes' rows, whose
# alignment changes with their count: read as scalars, they gain nothing from it (Triton >= 3.1)
_JIT = dict(do_not_specialize=["s_tb"])
if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
    _JIT["do_not_specialize_on_alignment"] = ["table_ptr", "seq_lens_ptr", "qsl_ptr", "trows_ptr"]


@triton.jit(**_JIT)
def paged_prefill_kernel(
    q_ptr,  # [T, Hq, D]
    out_ptr,  # [T, Hq, D]
    key_ptr, value_ptr,  # EXACT: [T, Hkv, D] each, the chunks' keys and values as computed
    data_ptr, scale_ptr, kmeta_ptr, vmeta_ptr, tail_ptr, vtail_ptr,  # the cache (see kv_tile.load_kv_tile)
    trows_ptr,  # [B] int32 (HAS_TAIL): each sequence's tail row, -1: none
    table_ptr,  # [B, M] int32
    seq_lens_ptr,  # [B] int32: context length including this chunk
    qsl_ptr,  # [B+1] int32: query_start_loc
    sm_scale,
    s_qt, s_qh, s_ot, s_oh, s_tb, s_kt, s_kh, s_vt, s_vh,
    s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh, s_tt, s_th,
    G: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    FMT: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, GV: tl.constexpr, GK: tl.constexpr, HAS_TAIL: tl.constexpr,
    WORDS: tl.constexpr, LANES: tl.constexpr, ASM: tl.constexpr, BIASED: tl.constexpr, DQ: tl.constexpr,  # the decode loops' (paged_decode; BIASED: decode's alone)
    EXACT: tl.constexpr,
):
    mt = tl.program_id(0)
    b = tl.program_id(1)
    hq = tl.program_id(2)
    h = hq // G
    q0 = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q0
    seq_len = tl.load(seq_lens_ptr + b)
    trow = tl.full([], -1, tl.int32)
    if HAS_TAIL:
        trow = tl.load(trows_ptr + b)
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    qpos = seq_len - q_len + rows  # [BLOCK_M]
    c = tl.arange(0, D)
    tok = (q0 + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * s_qt + hq * s_qh + c[None, :], mask=rmask[:, None], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634
    q, tile_scale = tile_query(q, qk_scale, FMT, DOT)  # generic_tile's (INT4R's rounded to int8)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # keys up to the last valid row's position; an empty tile (mt * BLOCK_M >= q_len) loops zero times
    kv_end = tl.where(mt * BLOCK_M < q_len, tl.minimum(seq_len, seq_len - q_len + (mt + 1) * BLOCK_M), 0)
    # the cached positions the rows read: all of them, or (EXACT) the prefix before the chunk
    ctx_end = kv_end
    if EXACT:
        ctx_end = tl.minimum(kv_end, seq_len - q_len)
    table = table_ptr + b.to(tl.int64) * s_tb
    cache_args = (data_ptr, scale_ptr, kmeta_ptr, vmeta_ptr, table, seq_len, h,
                  s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
                  tail_ptr, vtail_ptr, trow, s_tt, s_th)
    # NOTE: quantized contexts go through the decode kernel's loops (codes read as words / lanes,
    # converted without conversion instructions), causal per row; INT4's partial last block, if the
    # rows reach it, through the generic tile load.
    if FMT == 1 and WORDS:
        m_i, l_i, acc = int8_words_loop(
            q_ptr, tok * s_qt + hq * s_qh, rmask, qpos, data_ptr, scale_ptr, table, h, 0, ctx_end,
            m_i, l_i, qk_scale, s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, BLOCK_M, TILE, D, BS, DOT, PREC, ASM, True,
        )
    elif FMT >= 2 and LANES:
        # whole blocks up to the last the rows reach (blocks past kv_end are full: the causal mask
        # drops their positions; EXACT: the prefix's whole blocks), then at most a partial block
        # (< BS <= TILE positions)
        if EXACT:
            full = ctx_end // BS * BS
        else:
            full = tl.minimum((kv_end + BS - 1) // BS * BS, (seq_len // BS) * BS)
        if FMT == 3:
            m_i, l_i, acc = int4_tokens_loop(
                q_ptr, tok * s_qt + hq * s_qh, rmask, qpos, data_ptr, kmeta_ptr, vmeta_ptr, table, h, 0, full,
                m_i, l_i, qk_scale, s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
                # NOTE: unbiased: the bias's extra dot costs more than it saves over 64 query rows
                BLOCK_M, TILE, D, BS, DOT, PREC, ASM, True, False,
            )
        else:
            m_i, l_i, acc = int4_lanes_loop(
                q_ptr, tok * s_qt + hq * s_qh, rmask, qpos, data_ptr, kmeta_ptr, vmeta_ptr, table, h, 0, full,
                m_i, l_i, qk_scale, s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
                BLOCK_M, TILE, D, BS, GV, DOT, PREC, DQ, ASM, True,
                1,  # NOTE: the warps split the query rows (BLOCK_M), each holding every column of the scores
            )
        if full < ctx_end:
            m_i, l_i, acc = generic_tile(full, ctx_end, q, qpos, m_i, l_i, acc, tile_scale, cache_args,
                                         TILE, DOT, PREC, FMT, D, BS, GV, GK)
    else:
        for s in range(0, ctx_end, TILE):
            m_i, l_i, acc = generic_tile(s, ctx_end, q, qpos, m_i, l_i, acc, tile_scale, cache_args,
                                         TILE, DOT, PREC, FMT, D, BS, GV, GK)
    if EXACT:
        # the chunk's own positions (from seq_len - q_len), its row q0 at the first
        for s in range(ctx_end, kv_end, TILE):
            m_i, l_i, acc = chunk_tile(s, kv_end, q0 - (seq_len - q_len), q, qpos, m_i, l_i, acc, tile_scale,
                                       key_ptr, value_ptr, (s_kt, s_kh, s_vt, s_vh), h, TILE, DOT, PREC, D)
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * s_ot + hq * s_oh + c[None, :], res.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    cache,  # llmbus.kernels.kv_cache.PagedKVCache
    block_tables: torch.Tensor,  # [B, M] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    scale: float,
    max_query_len: int | None = None,
    block_m: int | None = None,
    tail_rows: torch.Tensor | None = None,  # [B] int32: INT4 / INT4R tail row per sequence, -1: none
    tile: int | None = None,  # KV positions a step (default: paged_decode.tile_size's, 64 on CUDA)
    chunk: tuple[torch.Tensor, torch.Tensor] | None = None,  # the chunks' keys and values [T, Hkv, D] as computed
) -> torch.Tensor:  # [T, Hq, D]
    """Triton twin of ``reference.paged_prefill_attention_cache``. With ``chunk`` the rows of a
    quantized cache attend to their own chunk exactly (a model-dtype cache holds it exactly)."""
    ptrs, strides, consts = tile_args(cache, tail_rows)
    t, hq, d = query.shape
    hkv = cache.layout.num_kv_heads
    b = seq_lens.shape[0]
    if d != cache.layout.head_dim or hq % hkv:
        raise ValueError(f"query must be [T, k*{hkv}, {cache.layout.head_dim}], got {list(query.shape)}")
    for name, x in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if x.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    if block_tables.shape[0] != b or query_start_loc.shape != (b + 1,) or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be [B, M] with contiguous rows and query_start_loc [B+1]")
    if query.stride(-1) != 1:  # NOTE: the kernels take row and head strides (q is a view of qkv)
        query = query.contiguous()
    exact = chunk is not None and cache.fmt.quantized
    key, value = chunk if exact else (query, query)
    if exact:
        for name, x in (("key", key), ("value", value)):
            if x.shape != (t, hkv, d) or x.dtype != query.dtype or x.stride(-1) != 1:
                raise ValueError(f"chunk {name} must be [{t}, {hkv}, {d}] {query.dtype} with contiguous rows, "
                                 f"got {list(x.shape)} {x.dtype}")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if t == 0 or b == 0:
        return out
    max_q = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if max_query_len is None else max_query_len
    block_m = block_m or (64 if query.is_cuda else 16)
    tile = tile_size(cache, tile, query.is_cuda, 64)
    grid = (triton.cdiv(max(1, max_q), block_m), b, hq)
    paged_prefill_kernel[grid](
        query, out, key, value, *ptrs, block_tables, seq_lens, query_start_loc, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *(key.stride()[:2] + value.stride()[:2] if exact else (0, 0, 0, 0)),
        *strides, G=hq // hkv, BLOCK_M=block_m, TILE=tile, **code_args(cache, query), **consts, EXACT=exact,
        **({"num_stages": pipeline_stages(cache, tile, None)} if query.is_cuda else {}),
    )
    return out
