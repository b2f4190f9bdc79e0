"""Triton KV write: scatter new keys/values into a paged cache by slot, quantizing for int8/int4.

One program per (token, KV head). INT4 keys follow ``llmbus.kv.formats``: a token whose slot is
not its block's last is stored per token (the partial-block encoding); the program of the token
that writes a block's last slot re-quantizes the whole block per channel, taking this launch's keys
from the input and earlier ones from the sealing token's exact tail row (or, without one, from
the partial encoding); a token of a block left filling also copies its key and value into its tail
row.
Programs of other tokens of a block sealed in this launch leave the keys alone, so no two programs
write the same bytes. INT4R (FMT 3) stores every key per token, as INT4 stores a filling block's,
and seals nothing; its tail rows are written under INT4's rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmbus.kernels.kv_cache import PagedKVCache
from llmbus.kernels.kv_tile import FMT_IDS


@triton.jit
def _safe_div(x, s):
    return tl.where(s > 0, x / tl.where(s > 0, s, 1.0), 0.0)


@triton.jit
def _int8_row(x_ptr, out_ptr, scale_ptr, D: tl.constexpr):
    """Quantize one row symmetrically: int8 at out_ptr, its scale (in scale_ptr's dtype) at scale_ptr."""
    x = tl.load(x_ptr + tl.arange(0, D)).to(tl.float32)
    s = (tl.max(tl.abs(x), axis=0) / 127.0).to(scale_ptr.dtype.element_ty)
    q = tl.minimum(tl.maximum(tl.floor(_safe_div(x, s.to(tl.float32)) + 0.5), -127.0), 127.0)
    tl.store(out_ptr + tl.arange(0, D), q.to(tl.int8))
    tl.store(scale_ptr, s)


@triton.jit
def _chan_quant(x, lof, step):
    """Per-channel INT4 of a [BS, C] tile on two-level ranges: (q int32 [BS, C], codes int16 [C])."""
    m = tl.minimum(tl.maximum(tl.floor(_safe_div(tl.min(x, axis=0) - lof, step)), 0.0), 255.0)
    mm = tl.minimum(tl.maximum(-tl.floor(-_safe_div(tl.max(x, axis=0) - lof, step)), 0.0), 255.0)
    cmin = lof + m * step
    cscale = (mm - m) * step / 15.0
    q = tl.minimum(tl.maximum(tl.floor(_safe_div(x - cmin[None, :], cscale[None, :]) + 0.5), 0.0), 15.0)
    return q.to(tl.int32), (m.to(tl.int32) | (mm.to(tl.int32) << 8)).to(tl.int16)


@triton.jit
def _int4_row(x_ptr, out_ptr, meta_ptr, META_STRIDE: tl.constexpr, D: tl.constexpr, G: tl.constexpr):
    """Quantize one row of D channels per group of G; write D/2 packed bytes and (scale, min) pairs
    as fp16 bit patterns at ``meta_ptr + g * META_STRIDE`` and ``+ 1`` (meta_ptr is int16)."""
    NG: tl.constexpr = D // G
    g = tl.arange(0, NG)[:, None]
    j = tl.arange(0, G // 2)[None, :]
    xe = tl.load(x_ptr + g * G + 2 * j).to(tl.float32)  # [NG, G/2] even channels
    xo = tl.load(x_ptr + g * G + 2 * j + 1).to(tl.float32)  # [NG, G/2] odd channels
    mn = tl.minimum(tl.min(xe, axis=1), tl.min(xo, axis=1)).to(tl.float16)
    mx = tl.maximum(tl.max(xe, axis=1), tl.max(xo, axis=1))
    sc = ((mx - mn.to(tl.float32)) / 15.0).to(tl.float16)
    mnf = mn.to(tl.float32)[:, None]
    scf = sc.to(tl.float32)[:, None]
    qe = tl.minimum(tl.maximum(tl.floor(_safe_div(xe - mnf, scf) + 0.5), 0.0), 15.0).to(tl.int32)
    qo = tl.minimum(tl.maximum(tl.floor(_safe_div(xo - mnf, scf) + 0.5), 0.0), 15.0).to(tl.int32)
    tl.store(out_ptr + g * (G // 2) + j, (qe | (qo << 4)).to(tl.uint8))
    gm = tl.arange(0, NG)
    tl.store(meta_ptr + gm * META_STRIDE, sc.to(tl.int16, bitcast=True))
    tl.store(meta_ptr + gm * META_STRIDE + 1, mn.to(tl.int16, bitcast=True))


# NOTE: T, the step's token count, changes every step: specialized (T == 1, T % 16 == 0) an eager
# serving run would compile new variants mid-stream for no gain; it only bounds a mask
@triton.jit(do_not_specialize=["T"])
def write_kv_kernel(
    key_ptr,  # [T, H, D] float
    value_ptr,  # [T, H, D] float
    slot_ptr,  # [T] int64
    data_ptr,  # [2, N, BS, H, D] model dtype | int8 [2, N, BS, H, D] | uint8 [2, N, BS, H, D/2]
    scale_ptr,  # int8: [2, N, BS, H] fp16/fp32 (else unused)
    kmeta_ptr,  # int4, int4r: int16 [N, H, KS] (else unused)
    vmeta_ptr,  # int4, int4r: fp16 [N, BS, H, D/GV, 2] (else unused)
    tail_ptr,  # int4, int4r with HAS_TAIL: model dtype [rows * BS, H, D] exact keys of the tail rows
    vtail_ptr,  # int4, int4r with HAS_TAIL: their exact values, same shape and strides
    tail_slot_ptr,  # int4, int4r with HAS_TAIL: [T] int64, row * BS + block offset, or -1
    T,
    s_kt, s_kh, s_vt, s_vh,
    s_dc, s_dn, s_db, s_dh,
    s_sc, s_sn, s_sb, s_sh,
    s_kmn, s_kmh,
    s_vmn, s_vmb, s_vmh,
    s_tt, s_th,
    FMT: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, GV: tl.constexpr, GK: tl.constexpr,
    HAS_TAIL: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BS  # NOTE: int64, so blk * s_dn cannot overflow
    off = slot % BS
    kp = key_ptr + t.to(tl.int64) * s_kt + h * s_kh
    vp = value_ptr + t.to(tl.int64) * s_vt + h * s_vh
    row = blk * s_dn + off * s_db + h * s_dh
    c = tl.arange(0, D)
    if FMT == 0:
        tl.store(data_ptr + row + c, tl.load(kp + c).to(data_ptr.dtype.element_ty))
        tl.store(data_ptr + s_dc + row + c, tl.load(vp + c).to(data_ptr.dtype.element_ty))
    elif FMT == 1:
        srow = blk * s_sn + off * s_sb + h * s_sh
        _int8_row(kp, data_ptr + row, scale_ptr + srow, D)
        _int8_row(vp, data_ptr + s_dc + row, scale_ptr + s_sc + srow, D)
    else:
        NGK: tl.constexpr = D // GK
        vm = vmeta_ptr + blk * s_vmn + off * s_vmb + h * s_vmh
        _int4_row(vp, data_ptr + s_dc + row, vm, 2, D, GV)
        km = kmeta_ptr + blk * s_kmn + h * s_kmh
        t_fill = t + (BS - 1 - off)
        fill_slot = tl.load(slot_ptr + t_fill, mask=t_fill < T, other=-1)
        ts = tl.full([], -1, tl.int64)
        if HAS_TAIL:
            ts = tl.load(tail_slot_ptr + t).to(tl.int64)
        tp = tail_ptr + h * s_th
        vtp = vtail_ptr + h * s_th
        filling = fill_slot != slot + (BS - 1 - off)  # no program of this launch writes the block's last slot
        if FMT == 3:
            _int4_row(kp, data_ptr + row, km + off * (NGK * 2), 2, D, GK)
            if (ts >= 0) & filling:
                tl.store(tp + ts * s_tt + c, tl.load(kp + c).to(tail_ptr.dtype.element_ty))
                tl.store(vtp + ts * s_tt + c, tl.load(vp + c).to(vtail_ptr.dtype.element_ty))
        elif off == BS - 1:
            _seal_block(kp, slot_ptr, data_ptr + blk * s_dn + h * s_dh, km, tp, t, slot, ts,
                        s_kt, s_db, s_tt, D, BS, GK)
        elif filling:
            _int4_row(kp, data_ptr + row, km + off * (NGK * 2), 2, D, GK)
            if ts >= 0:
                tl.store(tp + ts * s_tt + c, tl.load(kp + c).to(tail_ptr.dtype.element_ty))
                tl.store(vtp + ts * s_tt + c, tl.load(vp + c).to(vtail_ptr.dtype.element_ty))


@triton.jit
def _seal_block(kp, slot_ptr, blk_ptr, km, tp, t, slot, ts, s_kt, s_db, s_tt,
                D: tl.constexpr, BS: tl.constexpr, GK: tl.constexpr):
    """Re-quantize the keys of a full block per channel (see llmbus.kv.formats): this launch's
    keys from the input, earlier ones from tail row ``ts // BS`` if ``ts >= 0``, else decoded."""
    NGK: tl.constexpr = D // GK
    o = tl.arange(0, BS)[:, None]  # [BS, 1] offset in block
    j = tl.arange(0, D // 2)[None, :]  # [1, D/2] channel pair
    back = BS - 1 - o
    src = t - back
    src_slot = tl.load(slot_ptr + src, mask=src >= 0, other=-1)
    fresh = src_slot == slot - back  # [BS, 1] this launch wrote that slot
    kin = kp - back.to(tl.int64) * s_kt
    xe_in = tl.load(kin + 2 * j, mask=fresh, other=0.0).to(tl.float32)
    xo_in = tl.load(kin + 2 * j + 1, mask=fresh, other=0.0).to(tl.float32)
    byte = tl.load(blk_ptr + o * s_db + j).to(tl.int32)
    mslot = (o * NGK + (2 * j) // GK) * 2
    sc = tl.load(km + mslot).to(tl.float16, bitcast=True).to(tl.float32)
    mn = tl.load(km + mslot + 1).to(tl.float16, bitcast=True).to(tl.float32)
    trow_id = ts - back  # [BS, 1] tail slot of each offset: >= 0 iff the block has a tail row
    exact = (src_slot != slot - back) & (trow_id >= 0)
    trow = tp + trow_id.to(tl.int64) * s_tt
    xe_t = tl.load(trow + 2 * j, mask=exact, other=0.0).to(tl.float32)
    xo_t = tl.load(trow + 2 * j + 1, mask=exact, other=0.0).to(tl.float32)
    xe = tl.where(fresh, xe_in, tl.where(exact, xe_t, mn + (byte & 15).to(tl.float32) * sc))
    xo = tl.where(fresh, xo_in, tl.where(exact, xo_t, mn + ((byte >> 4) & 15).to(tl.float32) * sc))
    lo = tl.minimum(tl.min(tl.min(xe, axis=1), axis=0), tl.min(tl.min(xo, axis=1), axis=0))
    hi = tl.maximum(tl.max(tl.max(xe, axis=1), axis=0), tl.max(tl.max(xo, axis=1), axis=0))
    lo16 = (lo - tl.abs(lo) * 0.001953125).to(tl.float16)  # RANGE_PAD = 2**-9
    hi16 = (hi + tl.abs(hi) * 0.001953125).to(tl.float16)
    lof = lo16.to(tl.float32)
    step = (hi16.to(tl.float32) - lof) / 255.0
    qe, codes_e = _chan_quant(xe, lof, step)
    qo, codes_o = _chan_quant(xo, lof, step)
    tl.store(km + 2 * tl.arange(0, D // 2), codes_e)
    tl.store(km + 2 * tl.arange(0, D // 2) + 1, codes_o)
    tl.store(blk_ptr + o * s_db + j, (qe | (qo << 4)).to(tl.uint8))
    tl.store(km + D, lo16.to(tl.int16, bitcast=True))
    tl.store(km + D + 1, hi16.to(tl.int16, bitcast=True))


def write_kv(key, value, cache: PagedKVCache, slot_mapping, tail_slots=None) -> None:
    """Launch ``write_kv_kernel``: the Triton twin of ``reference.write_kv_cache``."""
    t, h, d = key.shape
    lay = cache.layout
    if value.shape != key.shape or h != lay.num_kv_heads or d != lay.head_dim:
        raise ValueError(f"key/value must be [T, {lay.num_kv_heads}, {lay.head_dim}], got {list(key.shape)} and {list(value.shape)}")
    if slot_mapping.shape != (t,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{t}], got {slot_mapping.dtype} {list(slot_mapping.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in the head dimension")
    if d & (d - 1) or lay.block_size & (lay.block_size - 1):
        raise ValueError(f"Triton KV kernels need power-of-two head_dim and block_size, got {d} and {lay.block_size}")
    has_tail = tail_slots is not None and cache.fmt.keeps_tails
    if has_tail and (tail_slots.shape != (t,) or tail_slots.dtype != torch.int64):
        raise ValueError(f"tail_slots must be int64 [{t}], got {tail_slots.dtype} {list(tail_slots.shape)}")
    if has_tail and cache.k_tail is None:
        raise ValueError("tail_slots given but the cache has no tail rows")
    if t == 0:
        return
    fmt = cache.fmt.name
    data = cache.data
    scale = cache.scale if cache.scale is not None else data
    km = cache.k_meta if cache.k_meta is not None else data
    vm = cache.v_meta.view(torch.int16) if cache.v_meta is not None else data
    s_scale = scale.stride()[:4] if cache.scale is not None else (0, 0, 0, 0)
    s_km = km.stride()[:2] if cache.k_meta is not None else (0, 0)
    s_vm = vm.stride()[:3] if cache.v_meta is not None else (0, 0, 0)
    tail, vtail = (cache.k_tail, cache.v_tail) if has_tail else (key, value)
    gv, gk = cache.fmt.groups(d, lay.block_size)
    write_kv_kernel[(t, h)](
        key, value, slot_mapping, data, scale, km, vm, tail, vtail, tail_slots if has_tail else slot_mapping, t,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *data.stride()[:4], *s_scale, *s_km, *s_vm, tail.stride(0), tail.stride(1),
        FMT=FMT_IDS[fmt], D=d, BS=lay.block_size,
        GV=gv, GK=gk, HAS_TAIL=has_tail,
    )

