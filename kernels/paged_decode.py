"""Triton paged decode attention: one query token per sequence over its block table.

Grid ``(B, Hkv, SPLITS)``: a program takes every query head of one KV head's group (so each KV
tile is read once per group) and one contiguous slice of the context (split-K). With one split
it writes the output; with several it writes unnormalized partials that ``reduce_splits``
combines. Scores use base-2 exponentials throughout (``m`` is in log2 units).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_tile import dot_args, load_kv_tile, tile_args
from kernels.reduce_splits import reduce_splits

LOG2E = 1.4426950408889634


@triton.jit
def paged_decode_kernel(
    q_ptr,  # [B, Hq, D]
    out_ptr,  # [B, Hq, D] (not SPLIT) or fp32 [B, Hq, S, D] partial accumulators (SPLIT)
    ml_ptr,  # fp32 [B, Hq, S, 2]: running max (log2 units) and denominator (SPLIT)
    data_ptr, scale_ptr, kmeta_ptr, vmeta_ptr,  # the cache (see kv_tile.load_kv_tile)
    table_ptr,  # [B, M] int32
    seq_lens_ptr,  # [B] int32
    sm_scale,
    split_len,  # tokens per split, a multiple of TILE
    s_qb, s_qh, s_ob, s_oh, s_os, s_tb,
    s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
    G: tl.constexpr, GP: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    FMT: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, GV: tl.constexpr, GK: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sid = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    g = tl.arange(0, GP)
    c = tl.arange(0, D)
    heads = h * G + g
    gmask = g < G
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh + c[None, :], mask=gmask[:, None], other=0.0)
    q = q.to(DOT)
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    start = sid * split_len
    end = tl.minimum(seq_len, start + split_len)
    table = table_ptr + b.to(tl.int64) * s_tb
    for s in range(start, end, TILE):
        pos = s + tl.arange(0, TILE)
        k, v = load_kv_tile(
            data_ptr, scale_ptr, kmeta_ptr, vmeta_ptr, table, pos, seq_len, h,
            s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
            FMT, D, BS, GV, GK,
        )
        scores = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PREC) * qk_scale  # [GP, TILE]
        scores = tl.where((pos < seq_len)[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PREC)
        m_i = m_new
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


def choose_splits(batch: int, kv_heads: int, max_len: int, tile: int, device: torch.device) -> int:
    """Enough splits that ``batch * kv_heads * splits`` fills the device about twice over."""
    chunks = max(1, -(-max_len // tile))
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * sms // max(1, batch * kv_heads))
    return max(1, min(want, chunks, 64))


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    cache,  # kernels.kv_cache.PagedKVCache
    block_tables: torch.Tensor,  # [B, M] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    tile: int | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """Triton twin of ``reference.paged_decode_attention_cache``. ``num_splits`` None picks split-K
    from the device size; ``max_seq_len`` (else read from ``seq_lens``) bounds the split length."""
    ptrs, strides, consts = tile_args(cache)
    b, hq, d = query.shape
    hkv = cache.layout.num_kv_heads
    if d != cache.layout.head_dim or hq % hkv:
        raise ValueError(f"query must be [B, k*{hkv}, {cache.layout.head_dim}], got {list(query.shape)}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"block_tables and seq_lens must be int32, got {block_tables.dtype} and {seq_lens.dtype}")
    if block_tables.shape[0] != b or seq_lens.shape != (b,) or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be [B, M] with contiguous rows and seq_lens [B]")
    out_dtype = query.dtype
    if cache.fmt.name == "model" and query.dtype != cache.data.dtype:
        query = query.to(cache.data.dtype)
    query = query.contiguous()
    out = torch.empty_like(query)
    if b == 0:
        return out.to(out_dtype)
    bs = cache.layout.block_size
    tile = tile or max(bs, 64 if query.is_cuda else bs)
    if tile % bs:
        raise ValueError(f"tile must be a multiple of block_size {bs}, got {tile}")
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    splits = num_splits or choose_splits(b, hkv, max_len, tile, query.device)
    split_len = -(-max(1, -(-max_len // splits)) // tile) * tile
    grp = hq // hkv
    meta = dict(G=grp, GP=max(16, triton.next_power_of_2(grp)), TILE=tile, SPLIT=splits > 1,
                **dot_args(query), **consts)
    if splits == 1:
        paged_decode_kernel[(b, hkv, 1)](
            query, out, out, *ptrs, block_tables, seq_lens, scale, split_len,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1), 0, block_tables.stride(0),
            *strides, **meta,
        )
        return out.to(out_dtype)
    part = torch.empty(b, hq, splits, d, dtype=torch.float32, device=query.device)
    ml = torch.empty(b, hq, splits, 2, dtype=torch.float32, device=query.device)
    paged_decode_kernel[(b, hkv, splits)](
        query, part, ml, *ptrs, block_tables, seq_lens, scale, split_len,
        query.stride(0), query.stride(1), part.stride(0), part.stride(1), part.stride(2), block_tables.stride(0),
        *strides, **meta,
    )
    reduce_splits(part, ml, out)
    return out.to(out_dtype)
