"""Triton helpers of the paged decode kernel: the online-softmax step and the fast quantized tile loads.

Bandwidth is the point here, so the quantized paths never gather metadata per element and never
convert integers with conversion instructions (a quarter of the FP32 rate on recent GPUs, which
capped INT8 decode near a quarter of peak bandwidth): ``codes_f16`` builds the fp16 value of a
code by OR-ing it into the mantissa of 1024.0 and subtracting 1024 (exact for codes below 1024).

- INT8 feeds its codes (exact in fp16) straight into the dot and applies the per-token scales to
  the ``[G, TILE]`` scores and probabilities instead of the ``[TILE, D]`` tiles. From 64 channels
  up it reads each token row as 32-bit words (four codes each) and splits the channels into the four
  classes ``c % 4``, one word byte each: four dots of ``D/4`` channels replace one of ``D`` (a dot
  sums over channels in any order), so no byte is gathered on its own. Compiled for sm_90 this
  halves the registers and cuts the loop's instructions by a third (``scripts/kernel_cost.py``).
- INT4 full blocks load the packed bytes as ``[.., D/2]`` tiles (even channel in the low nibble,
  ``tl.interleave`` restores channel order), the per-channel key ranges once per block and the
  per-token value pairs once per group. The partial tail block takes the generic
  ``kv_tile.load_kv_tile`` path, once per sequence.
Encodings are documented in ``llmbus.kv.formats``; the arithmetic follows
``kernels.quant_reference`` operation for operation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.kv_tile import softmax_step


@triton.jit
def attend_tile(q, k, v, valid, ks, vs, m_i, l_i, acc, qk_scale,
                SCALED: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """One online-softmax update of ``(m_i [G], l_i [G], acc [G, D])`` by a ``[TILE, D]`` tile.
    With SCALED, row ``t`` of ``k`` / ``v`` is ``ks[t]`` / ``vs[t]`` times what was passed."""
    scores = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PREC)  # [G, TILE]
    if SCALED:
        scores = scores * (ks * qk_scale)[None, :]
    else:
        scores = scores * qk_scale
    m_new, alpha, p, l_i = softmax_step(tl.where(valid[None, :], scores, float("-inf")), m_i, l_i)
    if SCALED:
        p = p * vs[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def codes_f16(x):
    """Integer codes in 0..1023 (any integer dtype) -> the same values as fp16, without a conversion."""
    return ((x.to(tl.int16) & 1023) | 0x6400).to(tl.float16, bitcast=True) - 1024.0


def _s8_pair_ptx(byte: int) -> tl.constexpr:
    """PTX turning byte ``byte`` of two words ($1, $2) of signed int8 codes into one fp16 pair ($0):
    ``prmt`` puts the two bytes in the pair's low bytes (selector nibbles 0 and 2), ``lop3`` keeps
    them, flips their sign bits (+128) and sets 0x64 above each, ``sub.f16x2`` takes 1152 off."""
    return tl.constexpr(
        "{ .reg .b32 t, c; mov.b32 c, 0x64806480; "
        f"prmt.b32 t, $1, $2, {byte | (4 + byte) << 8:#06x}; "
        "lop3.b32 t, t, 0x00ff00ff, c, 0x6a; sub.f16x2 $0, t, c; }"
    )


S8_PAIR_0, S8_PAIR_1, S8_PAIR_2, S8_PAIR_3 = (_s8_pair_ptx(b) for b in range(4))


@triton.jit
def word_codes(w, SHIFT: tl.constexpr, ASM: tl.constexpr):
    """Signed int8 codes at bit ``SHIFT`` of int32 words -> their values as fp16, without a conversion:
    the byte offset by 128 goes into the mantissa of 1024.0, then 1024 + 128 comes off. With ASM
    (CUDA only: the interpreter runs no PTX) two words make one fp16 pair in three instructions."""
    if ASM:
        if SHIFT == 0:
            x = tl.inline_asm_elementwise(S8_PAIR_0, "=r,r,r", [w], dtype=tl.float16, is_pure=True, pack=2)
        elif SHIFT == 8:
            x = tl.inline_asm_elementwise(S8_PAIR_1, "=r,r,r", [w], dtype=tl.float16, is_pure=True, pack=2)
        elif SHIFT == 16:
            x = tl.inline_asm_elementwise(S8_PAIR_2, "=r,r,r", [w], dtype=tl.float16, is_pure=True, pack=2)
        else:
            x = tl.inline_asm_elementwise(S8_PAIR_3, "=r,r,r", [w], dtype=tl.float16, is_pure=True, pack=2)
    else:
        u = ((w >> SHIFT) & 0xFF) ^ 0x6480  # 0x64 above, the byte + 128 (mod 256) below
        x = u.to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
    return x


@triton.jit
def int8_words_loop(
    q_ptr, s_qh, heads, gmask,  # q_ptr: this sequence's query row; query heads [GP] and their mask
    data_ptr, scale_ptr, table, h, start, end,
    m_i, l_i, qk_scale,
    s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh,
    GP: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    ASM: tl.constexpr,
):
    """INT8 decode over positions ``[start, end)`` by channel class (module docstring); returns
    ``(m_i, l_i, acc [GP, D])``. The cache's strides are in bytes and multiples of 4 (D >= 64)."""
    j = tl.arange(0, D // 4)
    qrow = q_ptr + heads[:, None] * s_qh + 4 * j[None, :]
    q0 = tl.load(qrow, mask=gmask[:, None], other=0.0).to(DOT)
    q1 = tl.load(qrow + 1, mask=gmask[:, None], other=0.0).to(DOT)
    q2 = tl.load(qrow + 2, mask=gmask[:, None], other=0.0).to(DOT)
    q3 = tl.load(qrow + 3, mask=gmask[:, None], other=0.0).to(DOT)
    a0 = tl.zeros([GP, D // 4], tl.float32)
    a1 = tl.zeros([GP, D // 4], tl.float32)
    a2 = tl.zeros([GP, D // 4], tl.float32)
    a3 = tl.zeros([GP, D // 4], tl.float32)
    words = data_ptr.to(tl.pointer_type(tl.int32))
    for s in range(start, end, TILE):
        t = tl.arange(0, TILE)
        valid = s + t < end
        # NOTE: block ids go to int64 before any multiply: block_id * stride overflows int32 on big
        # caches. s is a multiple of TILE, so of BS: block and offset come from t alone.
        blk = tl.load(table + s // BS + t // BS, mask=valid, other=0).to(tl.int64)
        off = t % BS
        row = blk * s_dn + off * s_db + h * s_dh
        wrow = (row // 4)[:, None] + j[None, :]
        kw = tl.load(words + wrow, mask=valid[:, None], other=0)
        vw = tl.load(words + s_dc // 4 + wrow, mask=valid[:, None], other=0)
        srow = blk * s_sn + off * s_sb + h * s_sh
        ks = tl.load(scale_ptr + srow, mask=valid, other=0.0).to(tl.float32)
        vs = tl.load(scale_ptr + s_sc + srow, mask=valid, other=0.0).to(tl.float32)
        scores = tl.dot(q0, tl.trans(word_codes(kw, 0, ASM).to(DOT)), input_precision=PREC)
        scores = tl.dot(q1, tl.trans(word_codes(kw, 8, ASM).to(DOT)), scores, input_precision=PREC)
        scores = tl.dot(q2, tl.trans(word_codes(kw, 16, ASM).to(DOT)), scores, input_precision=PREC)
        scores = tl.dot(q3, tl.trans(word_codes(kw, 24, ASM).to(DOT)), scores, input_precision=PREC)
        scores = tl.where(valid[None, :], scores * (ks * qk_scale)[None, :], float("-inf"))
        m_new, alpha, p, l_i = softmax_step(scores, m_i, l_i)
        p = (p * vs[None, :]).to(DOT)
        a0 = a0 * alpha[:, None] + tl.dot(p, word_codes(vw, 0, ASM).to(DOT), input_precision=PREC)
        a1 = a1 * alpha[:, None] + tl.dot(p, word_codes(vw, 8, ASM).to(DOT), input_precision=PREC)
        a2 = a2 * alpha[:, None] + tl.dot(p, word_codes(vw, 16, ASM).to(DOT), input_precision=PREC)
        a3 = a3 * alpha[:, None] + tl.dot(p, word_codes(vw, 24, ASM).to(DOT), input_precision=PREC)
        m_i = m_new
    # channel 4 * j + r is class r's column j
    acc = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), [GP, D])
    return m_i, l_i, acc


@triton.jit
def int8_tile(
    data_ptr,  # int8 [2, N, BS, H, D]
    scale_ptr,  # [2, N, BS, H] fp16 | fp32
    table_ptr,  # [M] int32: this sequence's block table
    pos,  # [TILE] int32 token positions
    valid,  # [TILE] bool
    h,
    s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh,
    D: tl.constexpr, BS: tl.constexpr,
):
    """``(kq, vq, ks, vs)``: codes ``[TILE, D]`` as fp16 and fp32 scales ``[TILE]`` (zeros where not valid)."""
    # NOTE: block ids go to int64 before any multiply: block_id * stride overflows int32 on big caches.
    blk = tl.load(table_ptr + pos // BS, mask=valid, other=0).to(tl.int64)
    off = pos % BS
    row = (blk * s_dn + off * s_db + h * s_dh)[:, None] + tl.arange(0, D)[None, :]
    srow = blk * s_sn + off * s_sb + h * s_sh
    # NOTE: q + 128 is in 1..255 (the codes are symmetric, never -128), so codes_f16 sees no sign
    kq = codes_f16(tl.load(data_ptr + row, mask=valid[:, None], other=0).to(tl.int16) + 128) - 128.0
    vq = codes_f16(tl.load(data_ptr + s_dc + row, mask=valid[:, None], other=0).to(tl.int16) + 128) - 128.0
    ks = tl.load(scale_ptr + srow, mask=valid, other=0.0).to(tl.float32)
    vs = tl.load(scale_ptr + s_sc + srow, mask=valid, other=0.0).to(tl.float32)
    return kq, vq, ks, vs


@triton.jit
def int4_full_tile(
    data_ptr,  # uint8 [2, N, BS, H, D/2]
    kmeta_ptr,  # int16 [N, H, KS]: per-channel codes, then lo, hi (fp16 bits)
    vmeta_ptr,  # int16 view of fp16 [N, BS, H, D/GV, 2]: (scale, min) per token and group
    table_ptr,  # [M] int32: this sequence's block table
    s0,  # first position of the tile, a multiple of BS
    lim,  # positions >= lim are masked; a multiple of BS (every block below it is full)
    h,
    s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
    TILE: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, GV: tl.constexpr, DQ: tl.constexpr,
):
    """Dequantized ``(k, v)``, each ``[TILE, D]`` in DQ (fp16 on GPUs), of ``TILE / BS`` full INT4 blocks."""
    NB: tl.constexpr = TILE // BS
    NG: tl.constexpr = D // GV
    # keys, as [NB, BS, D] so each block's per-channel range broadcasts over its tokens
    bi = s0 // BS + tl.arange(0, NB)
    bval = bi * BS < lim
    blk = tl.load(table_ptr + bi, mask=bval, other=0).to(tl.int64)  # [NB]
    off = tl.arange(0, BS)
    krow = blk[:, None] * s_dn + off[None, :] * s_db + h * s_dh  # [NB, BS]
    j = tl.arange(0, D // 2)
    kp = tl.load(data_ptr + krow[:, :, None] + j[None, None, :], mask=bval[:, None, None], other=0).to(tl.int16)
    kq = tl.interleave(codes_f16(kp & 15), codes_f16((kp >> 4) & 15)).to(DQ)  # [NB, BS, D]
    kb = blk * s_kmn + h * s_kmh
    code = tl.load(kmeta_ptr + kb[:, None] + tl.arange(0, D)[None, :], mask=bval[:, None], other=0).to(tl.int32)
    code = code & 0xFFFF
    lo = tl.load(kmeta_ptr + kb + D, mask=bval, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    hi = tl.load(kmeta_ptr + kb + D + 1, mask=bval, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    step = ((hi - lo) / 255.0)[:, None]
    m = (code & 255).to(tl.float32)
    cmin = lo[:, None] + m * step  # [NB, D]
    cscale = (((code >> 8) & 255).to(tl.float32) - m) * step / 15.0
    k = tl.reshape(cmin.to(DQ)[:, None, :] + kq * cscale.to(DQ)[:, None, :], [TILE, D])
    # values, as [TILE, NG, GV] so each token's (scale, min) pair broadcasts over its group
    pos = s0 + tl.arange(0, TILE)
    pval = pos < lim
    blkt = tl.load(table_ptr + pos // BS, mask=pval, other=0).to(tl.int64)
    offt = pos % BS
    g = tl.arange(0, NG)
    vrow = (blkt * s_dn + offt * s_db + h * s_dh)[:, None, None] + (g * (GV // 2))[None, :, None]
    jg = tl.arange(0, GV // 2)
    vp = tl.load(data_ptr + s_dc + vrow + jg[None, None, :], mask=pval[:, None, None], other=0).to(tl.int16)
    vq = tl.interleave(codes_f16(vp & 15), codes_f16((vp >> 4) & 15)).to(DQ)  # [TILE, NG, GV]
    vm = (blkt * s_vmn + offt * s_vmb + h * s_vmh)[:, None] + g[None, :] * 2  # [TILE, NG]
    vsc = tl.load(vmeta_ptr + vm, mask=pval[:, None], other=0).to(tl.float16, bitcast=True).to(DQ)
    vmn = tl.load(vmeta_ptr + vm + 1, mask=pval[:, None], other=0).to(tl.float16, bitcast=True).to(DQ)
    v = tl.reshape(vmn[:, :, None] + vq * vsc[:, :, None], [TILE, D])
    return k, v
