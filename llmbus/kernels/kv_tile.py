"""Triton helpers shared by the attention kernels: load a tile of a sequence's keys and values from
its paged cache, dequantizing int8/int4 on the fly (encodings in ``llmbus.kv.formats``), and the
online-softmax step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    data_ptr,  # [2, N, BS, H, D] model dtype | int8 [2, N, BS, H, D] | uint8 [2, N, BS, H, D/2]
    scale_ptr,  # int8: [2, N, BS, H]
    kmeta_ptr,  # int4, int4r: int16 [N, H, KS]
    vmeta_ptr,  # int4, int4r: int16 view of fp16 [N, BS, H, D/GV, 2]
    table_ptr,  # [M] int32: this sequence's block table
    pos,  # [TILE] int32 token positions
    seq_len,  # tokens of context: positions >= seq_len read as zero
    h,  # KV head
    s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
    tail_ptr,  # int4, int4r: model dtype [rows * BS, H, D] exact keys of the tail rows
    vtail_ptr,  # int4, int4r: their exact values, same shape and strides
    trow,  # int4, int4r: the tail row holding this sequence's partial last block; -1: none
    s_tt, s_th,
    FMT: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, GV: tl.constexpr, GK: tl.constexpr,
):
    """Returns ``(k, v)``, each ``[TILE, D]``: model dtype for FMT 0, fp32 otherwise. INT4 (FMT 2)
    and INT4R (FMT 3, every key per token) keys and values of a partial block come from tail row
    ``trow`` when it is >= 0, else from their codes."""
    valid = pos < seq_len
    bidx = pos // BS
    # NOTE: block ids go to int64 before any multiply: block_id * stride overflows int32 on big caches.
    blk = tl.load(table_ptr + bidx, mask=valid, other=0).to(tl.int64)
    off = pos % BS
    c = tl.arange(0, D)[None, :]
    vm2 = valid[:, None]
    row = (blk * s_dn + off * s_db + h * s_dh)[:, None]
    if FMT == 0:
        k = tl.load(data_ptr + row + c, mask=vm2, other=0.0)
        v = tl.load(data_ptr + s_dc + row + c, mask=vm2, other=0.0)
    elif FMT == 1:
        srow = blk * s_sn + off * s_sb + h * s_sh
        ks = tl.load(scale_ptr + srow, mask=valid, other=0.0).to(tl.float32)
        vs = tl.load(scale_ptr + s_sc + srow, mask=valid, other=0.0).to(tl.float32)
        k = tl.load(data_ptr + row + c, mask=vm2, other=0).to(tl.float32) * ks[:, None]
        v = tl.load(data_ptr + s_dc + row + c, mask=vm2, other=0).to(tl.float32) * vs[:, None]
    else:
        shift = (c % 2) * 4
        kq = ((tl.load(data_ptr + row + c // 2, mask=vm2, other=0).to(tl.int32) >> shift) & 15).to(tl.float32)
        vq = ((tl.load(data_ptr + s_dc + row + c // 2, mask=vm2, other=0).to(tl.int32) >> shift) & 15).to(tl.float32)
        vrow = (blk * s_vmn + off * s_vmb + h * s_vmh)[:, None] + (c // GV) * 2
        vsc = tl.load(vmeta_ptr + vrow, mask=vm2, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        vmn = tl.load(vmeta_ptr + vrow + 1, mask=vm2, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        v = vmn + vq * vsc
        kb = (blk * s_kmn + h * s_kmh)[:, None]
        full = ((bidx + 1) * BS <= seq_len)[:, None] & (FMT == 2)
        tail = ((bidx + 1) * BS > seq_len)[:, None]
        # full block: per-channel codes and the head's (lo, hi)
        code = tl.load(kmeta_ptr + kb + c, mask=vm2 & full, other=0).to(tl.int32) & 0xFFFF
        lo = tl.load(kmeta_ptr + kb + D, mask=vm2 & full, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        hi = tl.load(kmeta_ptr + kb + D + 1, mask=vm2 & full, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        step = (hi - lo) / 255.0
        m = (code & 255).to(tl.float32)
        cmin = lo + m * step
        cscale = (((code >> 8) & 255).to(tl.float32) - m) * step / 15.0
        # partial block: per-token groups
        tslot = kb + (off[:, None] * (D // GK) + c // GK) * 2
        tsc = tl.load(kmeta_ptr + tslot, mask=vm2 & (~full), other=0).to(tl.float16, bitcast=True).to(tl.float32)
        tmn = tl.load(kmeta_ptr + tslot + 1, mask=vm2 & (~full), other=0).to(tl.float16, bitcast=True).to(tl.float32)
        # partial block with a tail row: its exact keys and values (tpos < 0 iff trow is -1)
        tpos = (trow * BS + off).to(tl.int64)
        exact = vm2 & tail & (tpos >= 0)[:, None]
        trow_off = tpos[:, None] * s_tt + h * s_th + c
        tk = tl.load(tail_ptr + trow_off, mask=exact, other=0.0).to(tl.float32)
        tv = tl.load(vtail_ptr + trow_off, mask=exact, other=0.0).to(tl.float32)
        k = tl.where(full, cmin + kq * cscale, tl.where(exact, tk, tmn + kq * tsc))
        v = tl.where(exact, tv, v)
    return k, v


@triton.jit
def softmax_step(scores, m_i, l_i):
    """The online-softmax step over ``[rows, TILE]`` scores (log2 units, -inf where masked): the new
    running max, the factor rescaling what was accumulated, the tile's weights, the new denominator."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


FMT_IDS = {"model": 0, "int8": 1, "int4": 2, "int4r": 3}


def tile_args(cache, tail_rows: torch.Tensor | None = None) -> tuple[tuple, tuple, dict]:
    """``(pointers, strides, constexprs)`` of a ``PagedKVCache`` for the attention kernels:
    pointers ``data, scale, k_meta, v_meta, k_tail, v_tail, tail_rows``; strides in ``load_kv_tile``'s
    order, the tail's last; ``HAS_TAIL`` when ``tail_rows`` ([B] int32 per sequence, -1: none) is
    given for an INT4 or INT4R cache with tail rows. Unused pointers alias ``data`` and unused strides are 0."""
    lay, data = cache.layout, cache.data
    d, bs = lay.head_dim, lay.block_size
    if d & (d - 1) or bs & (bs - 1) or d < 16:
        raise ValueError(f"Triton KV kernels need power-of-two head_dim >= 16 and block_size, got {d} and {bs}")
    if data.stride(-1) != 1:
        raise ValueError("the KV cache must be contiguous in its last dimension")
    scale, km = cache.scale, cache.k_meta
    vm = cache.v_meta.view(torch.int16) if cache.v_meta is not None else None
    has_tail = tail_rows is not None and cache.k_tail is not None
    if has_tail and tail_rows.dtype != torch.int32:
        raise ValueError(f"tail_rows must be int32, got {tail_rows.dtype}")
    tail, vtail = (cache.k_tail, cache.v_tail) if has_tail else (data, data)
    ptrs = (data, scale if scale is not None else data, km if km is not None else data, vm if vm is not None else data,
            tail, vtail, tail_rows if has_tail else data)
    strides = (
        *data.stride()[:4],
        *(scale.stride()[:4] if scale is not None else (0, 0, 0, 0)),
        *(km.stride()[:2] if km is not None else (0, 0)),
        *(vm.stride()[:3] if vm is not None else (0, 0, 0)),
        *(tail.stride()[:2] if has_tail else (0, 0)),
    )
    gv, gk = cache.fmt.groups(d, bs)
    consts = dict(FMT=FMT_IDS[cache.fmt.name], D=d, BS=bs, GV=gv, GK=gk, HAS_TAIL=has_tail)
    return ptrs, strides, consts


def dot_args(query: torch.Tensor) -> dict:
    """Operand dtype and precision of the kernels' ``tl.dot``: the query's half dtype on CUDA, fp32
    elsewhere. NOTE: Triton's interpreter computes bf16 ``tl.dot`` wrongly (triton 3.9), so off CUDA
    the dots run in fp32."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        return dict(DOT=tl.float16 if query.dtype == torch.float16 else tl.bfloat16, PREC="tf32")
    return dict(DOT=tl.float32, PREC="ieee")
