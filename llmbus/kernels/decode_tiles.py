"""Triton helpers of the paged attention kernels: the online-softmax step and the fast quantized loops
(decode's, which prefill runs too with a causal mask per row).

Bandwidth is the point here, so the quantized paths never gather metadata per element and never
convert codes with conversion instructions (a quarter of the FP32 rate on recent GPUs, which
capped INT8 decode near a quarter of peak bandwidth): ``codes_f16`` builds the fp16 value of a
code by OR-ing it into the mantissa of 1024.0 and subtracting 1024 (exact for codes below 1024).
(INT4R's integer key dots convert their int32 scores, a tile's ``[R, TILE]``, not its codes.)

- INT8 feeds its codes (exact in fp16) straight into the dot and applies the per-token scales to
  the ``[G, TILE]`` scores and probabilities instead of the ``[TILE, D]`` tiles. From 64 channels
  up it reads each token row as 32-bit words (four codes each) and splits the channels into the four
  classes ``c % 4``, one word byte each: four dots of ``D/4`` channels replace one of ``D`` (a dot
  sums over channels in any order), so no byte is gathered on its own. Compiled for sm_90 this
  halves the registers and cuts the loop's instructions by a third (``scripts/kernel_cost.py``).
  A decode's whole tiles go unmasked (``int8_words_tile``), as INT4R's do. In fp16 dots (CUDA) a
  decode leaves its codes biased (``1152 + code``: two instructions a pair, not three) and takes the
  bias off the scores (``1152 * sum(q)`` a row) and, tile by tile, off the value sums.
- INT4 full blocks read their packed bytes as 16-bit lanes of four channels (``4k .. 4k + 3``,
  low nibble first) and split the channels into the four classes ``c % 4``, one nibble of each
  lane, as INT8 splits bytes: four dots of ``D/4`` channels, nothing interleaved. Reading lanes,
  not bytes, matters on CUDA: Triton lays a dot operand out by the narrowest load it derives from
  (four consecutive channels per thread from bytes, two from 16 bits up), and the four-channel
  layout cost a register move for every operand register of every ``mma`` (about 130 per
  iteration, compiled for sm_90: ``scripts/kernel_cost.py``). On CUDA an inline-PTX twin of
  ``lane_codes`` turns two lanes into a fp16 pair of each class in nine instructions. The partial
  tail block takes the generic ``kv_tile.load_kv_tile`` path, once per sequence.
- INT4 dequantizes in the dot operands' own layout. Codes loaded as plain ``[TILE, D/4]`` tiles,
  with each scale and minimum a broadcast of values loaded or converted once, let Triton read the
  codes from shared memory straight into the ``mma`` operand's registers. Dequantized tiles
  staged through shared memory (as ``[NB, BS, D/4]`` tiles did: a reshape of the codes stops
  that) cost four times the shared-memory traffic of the codes they held, and that bound the loop
  (``kernel_cost``'s smem bound: 53% of the H200's peak, now ~80%). Each block's per-channel key
  ranges are worked out once per channel (``compact``), all eight together, and broadcast over the
  tile's rows in one conversion (``key_ranges``). The rows are ordered so that each warp's score
  columns are whole blocks (``warp_rows``), which halves the blocks whose ranges a thread takes
  (one instead of two at the default launch). Each
  token's value (scale, min) pairs are read in the operand's layout and broadcast over its group.
- INT4's decode (head_dim 64 or 128) runs neither of those per element: ``int4_blocks_warp_loop``
  gives each block of a tile its own softmax (the dots batched over the blocks) and scales a copy
  of the queries by the block's per-channel key ranges (``block_query``: ``[D, R]`` a block,
  where dequantizing took ``[BS, D]``), the minima a ``[R]`` term a block; its tokens' value
  pairs fold into the weights a group at a time, as INT4R's do. Compiled for sm_90 its loop takes
  0.21 instructions a KV byte where the lane loop takes 0.29 (``scripts/kernel_cost.py``).
- INT4R (per-token pairs, rotated keys) folds each token's (scale, min) into the scores and weights
  as INT8 does, and rounds its queries to int8 per row, so its key dots are integer ones: the key
  codes are read as bytes and split by channel parity into int8 codes (three instructions a word,
  where fp16 codes take nine), two ``mma`` s8 dots of ``D/2`` channels each (IMMA, twice HMMA's
  rate). The one conversion is of the int32 scores, ``[R, TILE]``, not of the codes. Its values
  take INT4's lanes; in fp16 dots (CUDA) a decode leaves them biased (``1024 + code``, ``1024 +
  16 code`` in the high classes: five instructions a pair of lanes, not nine) and takes each
  tile's bias off its sums as they grow (``class_values``: one more dot, of the weights against
  1024). A decode's whole tiles go unmasked
  (``int4_tokens_tile``). Compiled for
  sm_90 the two took the 128-token loop from 837 instructions to 658 (``scripts/kernel_cost.py``).
- The quantized loops load each tile's block ids an iteration ahead (``next_blocks``). A tile's
  codes take their addresses from its ids; loaded in the same iteration, the ids left Triton's
  pipeliner one shared-memory buffer a load whatever ``num_stages`` said, and each tile's copy was
  issued just before it was needed (8 KB for INT4's 64-token tiles: ~32 KB an SM, about what the
  H200's latency needs in flight). Now ``num_stages`` 3 gives two buffers: the next tile's copy
  is in flight while the current one is used.
Encodings are documented in ``llmbus.kv.formats``; the arithmetic follows
``llmbus.kernels.quant_reference`` operation for operation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmbus.kernels.kv_tile import softmax_step


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


def _s8_pair_ptx(byte: int, biased: bool = False) -> tl.constexpr:
    """PTX turning byte ``byte`` of two words ($1, $2) of signed int8 codes into one fp16 pair ($0):
    ``prmt`` puts the two bytes in the pair's low bytes (selector nibbles 0 and 2), ``lop3`` keeps
    them, flips their sign bits (+128) and sets 0x64 above each, ``sub.f16x2`` takes 1152 off
    (``biased``: left on, ``1152 + code``)."""
    return tl.constexpr(
        "{ .reg .b32 t, c; mov.b32 c, 0x64806480; "
        f"prmt.b32 t, $1, $2, {byte | (4 + byte) << 8:#06x}; "
        + ("lop3.b32 $0, t, 0x00ff00ff, c, 0x6a; }" if biased else
           "lop3.b32 t, t, 0x00ff00ff, c, 0x6a; sub.f16x2 $0, t, c; }")
    )


S8_PAIR_0, S8_PAIR_1, S8_PAIR_2, S8_PAIR_3 = (_s8_pair_ptx(b) for b in range(4))
S8_BIASED_0, S8_BIASED_1, S8_BIASED_2, S8_BIASED_3 = (_s8_pair_ptx(b, True) for b in range(4))


# Two 16-bit lanes ($4: x0 low, x1 high) -> each channel class r's codes as one fp16 pair ($r: x0's,
# x1's): lop3 keeps one nibble of each half and sets 0x64 above it (the fp16 1024 + n, or 1024 + 16 n
# for a high nibble), which sub.f16x2 and fma.rn.f16x2 (x / 16 - 64) turn into n exactly; the upper
# byte's nibbles (classes 2, 3) first shift down by 8. The outputs are early-clobber (=&r): $4 is
# read after $0 is written.
U4_LANES = tl.constexpr(
    "{ .reg .b32 c, s, m, u; mov.b32 c, 0x64006400; mov.b32 s, 0x2c002c00; mov.b32 m, 0xd400d400; "
    "shr.b32 u, $4, 8; "
    "lop3.b32 $0, $4, 0x000f000f, c, 0xea; lop3.b32 $1, $4, 0x00f000f0, c, 0xea; "
    "lop3.b32 $2, u, 0x000f000f, c, 0xea; lop3.b32 $3, u, 0x00f000f0, c, 0xea; "
    "sub.f16x2 $0, $0, c; fma.rn.f16x2 $1, $1, s, m; sub.f16x2 $2, $2, c; fma.rn.f16x2 $3, $3, s, m; }"
)


# U4_LANES without its last four instructions: classes 0 and 2 as 1024 + code, 1 and 3 as 1024 + 16 code
U4_LANES_BIASED = tl.constexpr(
    "{ .reg .b32 c, u; mov.b32 c, 0x64006400; shr.b32 u, $4, 8; "
    "lop3.b32 $0, $4, 0x000f000f, c, 0xea; lop3.b32 $1, $4, 0x00f000f0, c, 0xea; "
    "lop3.b32 $2, u, 0x000f000f, c, 0xea; lop3.b32 $3, u, 0x00f000f0, c, 0xea; }"
)


@triton.jit
def lane_codes(x, ASM: tl.constexpr, BIASED: tl.constexpr = False):
    """16-bit lanes of packed INT4 codes (int16; channels ``4k .. 4k + 3``, low nibble first) -> the
    codes of each channel class ``c % 4`` as fp16, without a conversion. With ASM (CUDA only) two
    lanes make a fp16 pair of each class in nine instructions. BIASED leaves the values as the bits
    make them, ``1024 + code`` (classes 0 and 2) and ``1024 + 16 code`` (1 and 3), for a caller that
    takes the bias off its sums instead (``unbias``): five instructions, not nine."""
    if ASM:
        if BIASED:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                U4_LANES_BIASED, "=&r,=&r,=&r,=&r,r", [x], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=2)
        else:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                U4_LANES, "=&r,=&r,=&r,=&r,r", [x], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=2)
    elif BIASED:
        c0 = ((x & 0x000F) | 0x6400).to(tl.float16, bitcast=True)
        c1 = ((x & 0x00F0) | 0x6400).to(tl.float16, bitcast=True)
        c2 = (((x >> 8) & 0x000F) | 0x6400).to(tl.float16, bitcast=True)
        c3 = (((x >> 8) & 0x00F0) | 0x6400).to(tl.float16, bitcast=True)
    else:
        c0 = codes_f16(x & 15)
        c1 = codes_f16((x >> 4) & 15)
        c2 = codes_f16((x >> 8) & 15)
        c3 = codes_f16((x >> 12) & 15)
    return c0, c1, c2, c3


@triton.jit
def unbias(a0, a1, a2, a3, BIASED: tl.constexpr):
    """Class accumulators of ``lane_codes``' biased values (their bias taken off tile by tile,
    ``class_values``) -> of the codes: the high classes' come 16 times over."""
    if BIASED:
        a1, a3 = a1 * 0.0625, a3 * 0.0625
    return a0, a1, a2, a3


@triton.jit
def compact(x):
    """``x`` (any rank), unchanged. NOTE: a layout hint for Triton, which otherwise computes what feeds a
    ``tl.dot`` operand in that operand's layout, where a value broadcast over the tile's tokens is
    computed once per copy: behind a reduction it is computed once per element and then moved
    through shared memory (for INT4 key ranges, about a third of the loop's instructions:
    scripts/kernel_cost.py)."""
    return tl.sum(tl.join(x, tl.zeros_like(x)), axis=len(x.shape))


@triton.jit
def s8_pair(w, PTX: tl.constexpr):
    """Two int32 words -> one fp16 pair by ``PTX`` (``_s8_pair_ptx``)."""
    return tl.inline_asm_elementwise(PTX, "=r,r,r", [w], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def word_codes(w, SHIFT: tl.constexpr, ASM: tl.constexpr, BIASED: tl.constexpr = False):
    """Signed int8 codes at bit ``SHIFT`` of int32 words -> their values as fp16, without a conversion:
    the byte offset by 128 goes into the mantissa of 1024.0, then 1024 + 128 comes off (BIASED: left
    on, ``1152 + code``, for a caller that takes it off its sums). With ASM (CUDA only: the
    interpreter runs no PTX) two words make one fp16 pair in three instructions (BIASED: two)."""
    if ASM:
        if SHIFT == 0:
            x = s8_pair(w, S8_BIASED_0 if BIASED else S8_PAIR_0)
        elif SHIFT == 8:
            x = s8_pair(w, S8_BIASED_1 if BIASED else S8_PAIR_1)
        elif SHIFT == 16:
            x = s8_pair(w, S8_BIASED_2 if BIASED else S8_PAIR_2)
        else:
            x = s8_pair(w, S8_BIASED_3 if BIASED else S8_PAIR_3)
    else:
        u = ((w >> SHIFT) & 0xFF) ^ 0x6480  # 0x64 above, the byte + 128 (mod 256) below
        x = u.to(tl.int16).to(tl.float16, bitcast=True)
        if not BIASED:
            x = x - 1152.0
    return x


@triton.jit
def scale_at(scale_ptr, idx, valid, MASKED: tl.constexpr = True):
    """``scale_ptr[idx]`` as fp32 (0 where not ``valid``; without MASKED every index is read). NOTE: an fp16 scale comes out of the
    32-bit word that holds it and a neighbour (the scales must be word-aligned): Triton pipelines no
    load narrower than 4 bytes (cp.async), and a 16-bit one left in the loop waits out global
    memory's latency every iteration."""
    if scale_ptr.dtype.element_ty == tl.float16:
        w = load_rows(scale_ptr.to(tl.pointer_type(tl.int32)) + (idx >> 1), valid, MASKED)
        x = (w >> ((idx & 1).to(tl.int32) << 4)).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        x = load_rows(scale_ptr + idx, valid, MASKED)
    return x.to(tl.float32)


@triton.jit
def half_pair(w):
    """The two fp16 halves of int32 words (low, high) as fp32."""
    lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def row_mask(pos, valid, qpos, CAUSAL: tl.constexpr):
    """Which of a tile's positions ``pos`` [TILE] (loaded where ``valid``) each row attends to:
    all valid ones (decode), or (CAUSAL: prefill) those up to the row's own position ``qpos`` [R].
    ``[R, TILE]`` (any leading dimensions of ``pos`` and ``valid`` come first)."""
    rows: tl.constexpr = len(pos.shape) - 1
    allowed = tl.expand_dims(valid, rows)
    if CAUSAL:
        allowed = allowed & (tl.expand_dims(pos, rows) <= last_dim(qpos))
    return allowed


@triton.jit
def next_blocks(table, s, end, t, BS: tl.constexpr):
    """The block ids ``[TILE]`` of a tile's tokens ``s + t`` (0 from ``end``). NOTE: the quantized loops
    load each tile's ids one iteration ahead, so that no load in the loop takes its address from
    another load of the same iteration: Triton's pipeliner then keeps two tiles of codes in flight
    (``num_stages`` 3), where it kept one (the KV cache's codes took a buffer each in shared memory,
    not two). The ids are plain loads, used an iteration after they are issued."""
    # NOTE: unsigned, as positions are: a signed // costs a correction (21 of prefill's INT4R loop)
    return tl.load(table + ((s + t).to(tl.uint32) // BS).to(tl.int32), mask=s + t < end, other=0)


@triton.jit
def tile_rows(blk_n, table, s, end, t, TILE: tl.constexpr, BS: tl.constexpr):
    """The rows ``s + t`` of a tile in a loop over ``[start, end)`` (one token a row): which are
    valid, their block ids (``blk_n``, loaded an iteration ahead) as int64, their offsets in their
    blocks, and the next tile's ids (``next_blocks``). NOTE: int64 before any multiply: block_id *
    stride overflows int32 on big caches. s is a multiple of TILE, so of BS: a row's offset in its
    block comes from t alone."""
    return s + t < end, blk_n.to(tl.int64), t % BS, next_blocks(table, s + TILE, end, t, BS)


@triton.jit
def class_queries(q_ptr, qrows, rmask, D: tl.constexpr, DOT: tl.constexpr):
    """The query rows' (``q_ptr + qrows``, where ``rmask``) channels of each class ``c % 4`` (``[R, D/4]``
    each, column k: channel 4k + r)."""
    qrow = q_ptr + qrows[:, None] + 4 * tl.arange(0, D // 4)[None, :]
    q0 = tl.load(qrow, mask=rmask[:, None], other=0.0).to(DOT)
    q1 = tl.load(qrow + 1, mask=rmask[:, None], other=0.0).to(DOT)
    q2 = tl.load(qrow + 2, mask=rmask[:, None], other=0.0).to(DOT)
    q3 = tl.load(qrow + 3, mask=rmask[:, None], other=0.0).to(DOT)
    return q0, q1, q2, q3


@triton.jit
def class_accumulators(R: tl.constexpr, D: tl.constexpr):
    """Four zero fp32 accumulators ``[R, D/4]``, one per channel class."""
    zero = tl.zeros([R, D // 4], tl.float32)
    return zero, zero, zero, zero


@triton.jit
def join_classes(a0, a1, a2, a3):
    """Per-class columns ``[G, D/4]`` back into channel order ``[G, D]`` (channel 4k + r: class r's column k)."""
    return tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), [a0.shape[0], 4 * a0.shape[1]])


@triton.jit
def int8_words_loop(
    q_ptr, qrows, rmask, qpos,  # rows [GP] at q_ptr + qrows (where rmask); CAUSAL: each row's position
    data_ptr, scale_ptr, table, h, start, end,
    m_i, l_i, qk_scale,
    s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh,
    GP: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    ASM: tl.constexpr, CAUSAL: tl.constexpr,
    BIASED: tl.constexpr = False,  # the codes biased (word_codes; paged_decode.BIASED_VALUES)
):
    """INT8 attention over positions ``[start, end)`` by channel class (module docstring), from the
    initial state ``m_i``, ``l_i`` (its accumulator starts at zero); returns
    ``(m_i, l_i, acc [GP, D])``. The cache's strides are in bytes and multiples of 4 (D >= 64)."""
    qs = class_queries(q_ptr, qrows, rmask, D, DOT)
    qbias = word_query_bias(qs)
    a0, a1, a2, a3 = class_accumulators(GP, D)
    m_i, l_i, a0, a1, a2, a3 = int8_words_tiles(
        start, end, tl.arange(0, TILE), table, data_ptr, scale_ptr, h, qs, qbias, qk_scale, qpos, m_i, l_i,
        a0, a1, a2, a3, (s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh), TILE, BS, D, DOT, PREC, ASM, CAUSAL, BIASED,
        False)
    return m_i, l_i, join_classes(a0, a1, a2, a3)


@triton.jit
def word_query_bias(qs):
    """BIASED INT8 codes (``word_codes``): each row's scores carry ``1152 * sum(q)``, the queries
    ``qs`` (``class_queries``) as the dots take them."""
    q0, q1, q2, q3 = qs
    return 1152.0 * tl.sum(q0.to(tl.float32) + q1.to(tl.float32) + q2.to(tl.float32) + q3.to(tl.float32), axis=1)


@triton.jit
def int8_words_tiles(start, end, t, table, data_ptr, scale_ptr, h, qs, qbias, qk_scale, qpos, m_i, l_i,
                     a0, a1, a2, a3, strides,
                     TILE: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                     ASM: tl.constexpr, CAUSAL: tl.constexpr, BIASED: tl.constexpr, SWAP: tl.constexpr):
    """``int8_words_tile`` over the tiles of ``[start, end)`` (``t``: a tile's token offsets,
    ``[TILE]`` or split between warps ``[NW, TILE / NW]``); returns the state."""
    words = data_ptr.to(tl.pointer_type(tl.int32))
    # NOTE: each tile's block ids are loaded one iteration ahead (``next_blocks``)
    blk_n = next_blocks(table, start, end, t, BS)
    if CAUSAL:
        for s in range(start, end, TILE):
            blk_n, m_i, l_i, a0, a1, a2, a3 = int8_words_tile(
                s, t, blk_n, table, end, words, scale_ptr, strides, h, qs, qbias, qk_scale, qpos,
                m_i, l_i, a0, a1, a2, a3, TILE, BS, D, DOT, PREC, ASM, CAUSAL, True, BIASED, SWAP)
    else:
        # NOTE: as int4_tokens_tiles': whole tiles unmasked, the split's last one masked, once
        whole = start + tl.maximum(end - start, 0) // TILE * TILE  # NOTE: an idle split's end < start
        for s in range(start, whole, TILE):
            blk_n, m_i, l_i, a0, a1, a2, a3 = int8_words_tile(
                s, t, blk_n, table, end, words, scale_ptr, strides, h, qs, qbias, qk_scale, qpos,
                m_i, l_i, a0, a1, a2, a3, TILE, BS, D, DOT, PREC, ASM, CAUSAL, False, BIASED, SWAP)
        if whole < end:
            blk_n, m_i, l_i, a0, a1, a2, a3 = int8_words_tile(
                whole, t, blk_n, table, end, words, scale_ptr, strides, h, qs, qbias, qk_scale, qpos,
                m_i, l_i, a0, a1, a2, a3, TILE, BS, D, DOT, PREC, ASM, CAUSAL, True, BIASED, SWAP)
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def int8_words_tile(s, t, blk_n, table, end, words, scale_ptr, strides, h, qs, qbias, qk_scale, qpos,
                    m_i, l_i, a0, a1, a2, a3,
                    TILE: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                    ASM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, BIASED: tl.constexpr,
                    SWAP: tl.constexpr):
    """One tile of ``int8_words_loop`` (tokens ``s + t``): the next tile's block ids and the updated
    state. Without MASKED every token of the tile is below ``end``. SWAP (not CAUSAL; tokens
    ``[NW, TILE / NW]``): tokens down the dots' rows (``int8_words_warp_loop``), the queries
    ``qs`` as columns and ``qk_scale`` per row (``[1, R]``)."""
    s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh = strides
    q0, q1, q2, q3 = qs
    valid, blk, off, blk_n = tile_rows(blk_n, table, s, end, t, TILE, BS)
    # NOTE: >> 2, not // 4, on these non-negative offsets: a signed division costs a correction
    wrow = (blk * s_dn + off * s_db + h * s_dh) >> 2
    j = tl.arange(0, D // 4)
    wj = last_dim(wrow) + j  # each token's words
    kw = load_rows(words + wj, last_dim(valid), MASKED)
    srow = blk * s_sn + off * s_sb + h * s_sh
    if SWAP:
        # the value words transposed, [NW, D/4, TILE / NW]: the value dots' left operands
        vw = load_rows(words + (s_dc >> 2) + wrow[:, None, :] + j[None, :, None], valid[:, None, :], MASKED)
        ks = scale_at(scale_ptr, srow, valid, MASKED)
        vs = scale_at(scale_ptr, s_sc + srow, valid, MASKED)
        x = tl.dot(word_codes(kw, 0, ASM, BIASED).to(DOT), q0, input_precision=PREC)
        x = tl.dot(word_codes(kw, 8, ASM, BIASED).to(DOT), q1, x, input_precision=PREC)
        x = tl.dot(word_codes(kw, 16, ASM, BIASED).to(DOT), q2, x, input_precision=PREC)
        x = tl.dot(word_codes(kw, 24, ASM, BIASED).to(DOT), q3, x, input_precision=PREC)
        if BIASED:
            x = x - qbias
        x = x * last_dim(ks)
        if MASKED:
            x = tl.where(last_dim(valid), x, float("-inf"))
        m_new, alpha, p, l_i = scaled_softmax_step(x, m_i, l_i, qk_scale, 1)
        w = (p * last_dim(vs)).to(DOT)
        ae = alpha[:, None, :]
    else:
        vw = load_rows(words + (s_dc >> 2) + wj, last_dim(valid), MASKED)
        ks = compact(scale_at(scale_ptr, srow, valid, MASKED))
        vs = compact(scale_at(scale_ptr, s_sc + srow, valid, MASKED))
        scores = tl.dot(q0, tl.trans(word_codes(kw, 0, ASM, BIASED).to(DOT)), input_precision=PREC)
        scores = tl.dot(q1, tl.trans(word_codes(kw, 8, ASM, BIASED).to(DOT)), scores, input_precision=PREC)
        scores = tl.dot(q2, tl.trans(word_codes(kw, 16, ASM, BIASED).to(DOT)), scores, input_precision=PREC)
        scores = tl.dot(q3, tl.trans(word_codes(kw, 24, ASM, BIASED).to(DOT)), scores, input_precision=PREC)
        if BIASED:
            scores = scores - qbias[:, None]
        scores = scores * (ks * qk_scale)[None, :]
        if MASKED:
            scores = tl.where(row_mask(s + t, valid, qpos, CAUSAL), scores, float("-inf"))
        m_new, alpha, p, l_i = softmax_step(scores, m_i, l_i)
        w = (p * vs[None, :]).to(DOT)
        ae = alpha[:, None]
    a0, a1, a2, a3 = class_dots(vw, w, a0, a1, a2, a3, ae, 1152.0 if BIASED else 0.0, SWAP, True, ASM, DOT, PREC)
    return blk_n, m_new, l_i, a0, a1, a2, a3


@triton.jit
def int8_words_warp_loop(
    q_ptr, qrows, rmask,  # as int8_words_loop's (decode only: not causal)
    data_ptr, scale_ptr, table, h, start, end,
    m_i, l_i, qk_scale,
    s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh,
    R: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    ASM: tl.constexpr, BIASED: tl.constexpr,
    NW: tl.constexpr,  # the launch's warps: each takes TILE / NW tokens of a tile
):
    """``int8_words_loop`` with each warp its own online softmax over its own share of every tile,
    tokens down the dots' rows, merged once at the end (``int4_tokens_warp_loop``'s NOTE): the
    key words are the score dots' left operands as they are, the value words load transposed
    (``[NW, D/4, TILE / NW]``) to be the value dots' left operands, the query rows are the right
    operands' columns."""
    TW: tl.constexpr = TILE // NW
    q0, q1, q2, q3 = class_queries(q_ptr, qrows, rmask, D, DOT)
    qbias = word_query_bias((q0, q1, q2, q3))
    qs = (tl.broadcast_to(tl.trans(q0)[None, :, :], [NW, D // 4, R]),
          tl.broadcast_to(tl.trans(q1)[None, :, :], [NW, D // 4, R]),
          tl.broadcast_to(tl.trans(q2)[None, :, :], [NW, D // 4, R]),
          tl.broadcast_to(tl.trans(q3)[None, :, :], [NW, D // 4, R]))
    cs = tl.zeros([1, R], tl.float32) + qk_scale
    zero = tl.zeros([NW, D // 4, R], tl.float32)
    mw = tl.full([NW, R], -1.0e30, tl.float32)  # each warp's running max and denominator
    lw = tl.zeros([NW, R], tl.float32)
    t = tl.reshape(tl.arange(0, TILE), [NW, TW])  # warp w takes tokens w * TW + j
    mw, lw, a0, a1, a2, a3 = int8_words_tiles(  # decode only: not causal (no query positions)
        start, end, t, table, data_ptr, scale_ptr, h, qs, qbias, cs, None, mw, lw, zero, zero, zero, zero,
        (s_dc, s_dn, s_db, s_dh, s_sc, s_sn, s_sb, s_sh), TILE, BS, D, DOT, PREC, ASM, False, BIASED, True)
    m_out, l_out, acc, _ = merge_warps(m_i, l_i, mw, lw, a0, a1, a2, a3)
    return m_out, l_out, acc


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
def per_group(x, W: tl.constexpr):
    """Per-group values ``x`` [T, NG] repeated over each group's W columns: ``[T, NG * W]``."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], [x.shape[0], x.shape[1], W]), [x.shape[0], x.shape[1] * W])


@triton.jit
def key_range(kw, lo, step, SHIFT: tl.constexpr, DQ: tl.constexpr):
    """One channel class's key ranges ``(min, scale)`` in DQ, from the words ``kw`` [NB, D/4] that hold
    its (min code, max code) bytes at bit SHIFT, and each block's ``lo``, ``step`` [NB, 1]."""
    mn = ((kw >> SHIFT) & 255).to(tl.float32)
    return (lo + mn * step).to(DQ), ((((kw >> (SHIFT + 8)) & 255).to(tl.float32) - mn) * step / 15.0).to(DQ)


@triton.jit
def warp_rows(TILE: tl.constexpr, BS: tl.constexpr, NW: tl.constexpr):
    """The token (offset in its tile) each row of a ``[TILE, ..]`` key tile holds: ordered so that
    in the dot of ``[R, TILE]`` scores, where NW warps take its columns eight at a time in turn,
    each warp's columns are whole blocks of BS tokens. NOTE: attention is the same in any order of a
    tile's tokens (keys and values take the same one); this one halves the blocks whose per-channel
    ranges each thread of the ``mma`` layout needs (``row_blocks``). It assumes the score dot's warps
    all split its columns (``warpsPerCTA [1, NW]``: Triton's choice for up to 16 rows, every GQA
    group up to 16); elsewhere it is only correct, not faster. Tokens stay in order where a warp's
    share of a tile is not whole blocks."""
    r = tl.arange(0, TILE)
    if TILE >= NW * BS and BS % 8 == 0:
        return ((r // 8) % NW) * (TILE // NW) + (r // (8 * NW)) * 8 + r % 8
    else:
        return r


@triton.jit
def row_blocks(x, TILE: tl.constexpr, BS: tl.constexpr, NW: tl.constexpr):
    """Per-block values ``x`` [NB, C, 2, 2, 2] for each row of a tile in ``warp_rows`` order:
    ``[TILE, C, 2, 2, 2]``."""
    nb: tl.constexpr = x.shape[0]
    c: tl.constexpr = x.shape[1]
    if TILE >= NW * BS and BS % 8 == 0:
        # row r is token w * (TILE / NW) + 8 j + i, with (j, w, i) its digits in (TILE / 8NW, NW, 8);
        # its block is w * R + j // (BS / 8), R = TILE / (NW * BS) blocks a warp
        R: tl.constexpr = TILE // (NW * BS)
        y = tl.reshape(x, [NW, R, c * 8])
        y = tl.permute(y, (1, 0, 2))
        y = tl.broadcast_to(y[:, None, :, None, :], [R, BS // 8, NW, 8, c * 8])
    else:
        y = tl.broadcast_to(tl.reshape(x, [nb, c * 8])[:, None, :], [nb, BS, c * 8])
    return tl.reshape(y, [TILE, c, 2, 2, 2])


@triton.jit
def key_ranges(kwa, kwb, lo, step, TILE: tl.constexpr, BS: tl.constexpr, NW: tl.constexpr, DQ: tl.constexpr):
    """Every channel class's key ranges ``(min, scale)`` in DQ for each row of a tile (``warp_rows``
    order) ``[TILE, D/4]`` (``key_range``), from the words of classes 0, 1 (``kwa``) and 2, 3
    (``kwb``) [NB, D/4]. NOTE: the eight are computed per block, made ``compact`` as one tensor and
    broadcast over the rows before they are split, so that they reach the dot operand's layout in
    one conversion, not eight. (Each channel's eight then sit together in a thread's registers,
    and pairing neighbouring channels for the fp16x2 dequantization costs a ``PRMT`` each: ordering
    the joined tensor by channel pairs first compiled to the same code.)"""
    return split_ranges(row_blocks(joined_ranges(kwa, kwb, lo, step, DQ), TILE, BS, NW))


@triton.jit
def joined_ranges(kwa, kwb, lo, step, DQ: tl.constexpr):
    """The eight ``key_range`` s of classes 0, 1 (``kwa``) and 2, 3 (``kwb``) joined in one tensor
    ``[NB, D/4, 2, 2, 2]`` (``split_ranges``), worked out once per channel (``compact``)."""
    m0, s0 = key_range(kwa, lo, step, 0, DQ)
    m1, s1 = key_range(kwa, lo, step, 16, DQ)
    m2, s2 = key_range(kwb, lo, step, 0, DQ)
    m3, s3 = key_range(kwb, lo, step, 16, DQ)
    return compact(tl.join(tl.join(tl.join(m0, s0), tl.join(m1, s1)), tl.join(tl.join(m2, s2), tl.join(m3, s3))))


@triton.jit
def split_ranges(x):
    """``joined_ranges`` (or rows of it) split back: ``(min, scale)`` of classes 0 to 3."""
    a, b = tl.split(x)
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    m0, s0 = tl.split(a0)
    m1, s1 = tl.split(a1)
    m2, s2 = tl.split(b0)
    m3, s3 = tl.split(b1)
    return m0, s0, m1, s1, m2, s2, m3, s3


@triton.jit
def int4_lanes_loop(
    q_ptr, qrows, rmask, qpos,  # rows [GP] at q_ptr + qrows (where rmask); CAUSAL: each row's position
    data_ptr, kmeta_ptr, vmeta_ptr, table, h, start, end,  # end: a multiple of BS (full blocks only)
    m_i, l_i, qk_scale,
    s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
    GP: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, GV: tl.constexpr,
    DOT: tl.constexpr, PREC: tl.constexpr, DQ: tl.constexpr, ASM: tl.constexpr, CAUSAL: tl.constexpr,
    NW: tl.constexpr,  # the launch's warps (warp_rows)
):
    """INT4 attention over the full blocks in ``[start, end)`` by channel class (module docstring),
    from the initial state ``m_i``, ``l_i`` (its accumulator starts at zero); returns
    ``(m_i, l_i, acc [GP, D])``. The data's strides (bytes) are even and ``k_meta``,
    ``v_meta`` word-aligned (``paged_decode.int4_lanes``)."""
    NB: tl.constexpr = TILE // BS
    NG: tl.constexpr = D // GV
    k = tl.arange(0, D // 4)
    q0, q1, q2, q3 = class_queries(q_ptr, qrows, rmask, D, DOT)
    a0, a1, a2, a3 = class_accumulators(GP, D)
    lanes = data_ptr.to(tl.pointer_type(tl.int16))
    kwords = kmeta_ptr.to(tl.pointer_type(tl.int32))
    vwords = vmeta_ptr.to(tl.pointer_type(tl.int32))
    t = warp_rows(TILE, BS, NW)
    # NOTE: each tile's block ids are loaded one iteration ahead (``next_blocks``), per block and per row
    bi_n = start // BS + tl.arange(0, NB)
    blk_n = tl.load(table + bi_n, mask=bi_n * BS < end, other=0)
    blkt_n = next_blocks(table, start, end, t, BS)
    for s in range(start, end, TILE):
        # keys: [TILE, D/4] codes (rows in warp_rows order), each row's block's per-channel ranges
        bi = s // BS + tl.arange(0, NB)
        bval = bi * BS < end
        blk = blk_n.to(tl.int64)  # [NB]
        valid = s + t < end
        blkt = blkt_n.to(tl.int64)  # [TILE]: the table again, per row (a gather from blk would need a conversion)
        bi_n = bi + NB
        blk_n = tl.load(table + bi_n, mask=bi_n * BS < end, other=0)
        blkt_n = next_blocks(table, s + TILE, end, t, BS)
        offt = t % BS
        # NOTE: >> 1, not // 2, on these non-negative byte offsets: a signed division costs a correction
        krow = (blkt * s_dn + offt * s_db + h * s_dh) >> 1  # [TILE], in lanes
        kx = tl.load(lanes + krow[:, None] + k[None, :], mask=valid[:, None], other=0)
        k0, k1, k2, k3 = lane_codes(kx, ASM)
        # NOTE: metadata goes in 32-bit words throughout: Triton pipelines no load narrower than 4
        # bytes (cp.async), and a 16-bit one left in the loop waits out global memory's latency.
        # The range codes of channels 4k, 4k + 1 are word 2k, of 4k + 2, 4k + 3 word 2k + 1.
        kb = (blk * s_kmn + h * s_kmh) >> 1
        kwa = tl.load(kwords + kb[:, None] + 2 * k[None, :], mask=bval[:, None], other=0)  # [NB, D/4]
        kwb = tl.load(kwords + kb[:, None] + 2 * k[None, :] + 1, mask=bval[:, None], other=0)
        lohi = tl.load(kwords + kb + D // 2, mask=bval, other=0)  # (lo, hi)
        lo, hi = half_pair(lohi)
        lo, hi = lo[:, None], hi[:, None]
        step = (hi - lo) / 255.0
        cm0, cs0, cm1, cs1, cm2, cs2, cm3, cs3 = key_ranges(kwa, kwb, lo, step, TILE, BS, NW, DQ)
        k0 = cm0 + k0.to(DQ) * cs0
        k1 = cm1 + k1.to(DQ) * cs1
        k2 = cm2 + k2.to(DQ) * cs2
        k3 = cm3 + k3.to(DQ) * cs3
        scores = tl.dot(q0, tl.trans(k0.to(DOT)), input_precision=PREC)
        scores = tl.dot(q1, tl.trans(k1.to(DOT)), scores, input_precision=PREC)
        scores = tl.dot(q2, tl.trans(k2.to(DOT)), scores, input_precision=PREC)
        scores = tl.dot(q3, tl.trans(k3.to(DOT)), scores, input_precision=PREC)
        scores = tl.where(row_mask(s + t, valid, qpos, CAUSAL), scores * qk_scale, float("-inf"))
        m_new, alpha, p, l_i = softmax_step(scores, m_i, l_i)
        p = p.to(DOT)
        # values: each token's (scale, min) pairs, one per group, broadcast over the group's columns
        vrow = (s_dc + blkt * s_dn + offt * s_db + h * s_dh) >> 1
        vx = tl.load(lanes + vrow[:, None] + k[None, :], mask=valid[:, None], other=0)
        v0, v1, v2, v3 = lane_codes(vx, ASM)
        g = tl.arange(0, NG)
        vm = ((blkt * s_vmn + offt * s_vmb + h * s_vmh) >> 1)[:, None] + g[None, :]  # [TILE, NG]
        vw = tl.load(vwords + vm, mask=valid[:, None], other=0)  # (scale, min)
        vsc = per_group((vw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(DQ), GV // 4)
        vmn = per_group((vw >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(DQ), GV // 4)
        v0 = (vmn + v0.to(DQ) * vsc).to(DOT)
        v1 = (vmn + v1.to(DQ) * vsc).to(DOT)
        v2 = (vmn + v2.to(DQ) * vsc).to(DOT)
        v3 = (vmn + v3.to(DQ) * vsc).to(DOT)
        a0 = a0 * alpha[:, None] + tl.dot(p, v0, input_precision=PREC)
        a1 = a1 * alpha[:, None] + tl.dot(p, v1, input_precision=PREC)
        a2 = a2 * alpha[:, None] + tl.dot(p, v2, input_precision=PREC)
        a3 = a3 * alpha[:, None] + tl.dot(p, v3, input_precision=PREC)
        m_i = m_new
    return m_i, l_i, join_classes(a0, a1, a2, a3)


@triton.jit
def block_key_ranges(kwa, kwb, lohi):
    """Each block's per-channel key ranges ``(min, scale)`` by channel class, fp32 ``[NB, 1, D/4]``
    each (``key_range``: ready to broadcast over the query rows), from its words of classes 0, 1
    (``kwa``) and 2, 3 (``kwb``) ``[NB, D/4]`` and its ``(lo, hi)`` word ``[NB, 1]``, worked out once
    per channel (``compact``). NOTE: the ranges gain the rows' dimension joined, so they move into
    the queries' layout in one exchange through shared memory, not one (and two barriers) for each
    of the eight (Triton 3.6: 791 -> 764 instructions a tile of INT4's block loop at 32-token blocks)."""
    lo, hi = half_pair(lohi)
    return split_ranges(tl.expand_dims(joined_ranges(kwa, kwb, lo, (hi - lo) / 255.0, tl.float32), 1))


@triton.jit
def block_query(q, scale, DOT: tl.constexpr):
    """The query rows ``q`` [1, R, n] scaled per block by ``scale`` [NB, 1, n], as a dot's right operand
    ``[NB, n, R]`` in ``DOT``. NOTE: scaled with the channels last and then transposed, so that
    they reach the dot through shared memory a channel pair at a time (channels down the rows,
    Triton stored them a 16-bit element at a time)."""
    return tl.permute((q * scale).to(DOT), (0, 2, 1))


@triton.jit
def join_groups(a, c):
    """Two value groups' class accumulators ``[NB, GV/4, R]`` -> one ``[NB, GV/2, R]``, group 0's rows first."""
    x = tl.permute(tl.join(a, c), (0, 3, 1, 2))
    return tl.reshape(x, [a.shape[0], 2 * a.shape[1], a.shape[2]])


@triton.jit
def int4_blocks_tile(s, tb, blk_n, table, end, ptrs, strides, h, qs,
                     mw, lw, a0, a1, a2, a3, c0, c1, c2, c3, b0, b1,
                     TILE: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, GV: tl.constexpr, DOT: tl.constexpr,
                     PREC: tl.constexpr, ASM: tl.constexpr, MASKED: tl.constexpr, BIASED: tl.constexpr):
    """One tile of ``int4_blocks_warp_loop``: its blocks ``s / BS + [0, NB)``, one a slot (``tb``
    [NB, 1]: each slot's first token), whose ids ``blk_n`` were loaded an iteration ahead. Returns
    the next tile's ids and the updated state. Without MASKED every block of the tile is below ``end``."""
    lanes, kwords, vwords = ptrs
    s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh = strides
    valid, blk, _, blk_n = tile_rows(blk_n, table, s, end, tb, TILE, BS)  # [NB, 1]: a slot is one block
    off = tl.arange(0, BS)[None, :]
    row = blk * s_dn + off * s_db + h * s_dh  # [NB, BS], in lanes (the strides come in the pointers' units)
    k = tl.arange(0, D // 4)
    kx = load_rows(lanes + last_dim(row) + k[None, None, :], last_dim(valid), MASKED)  # [NB, BS, D/4]
    kb = blk * s_kmn + h * s_kmh  # [NB, 1], in words
    kwa = load_rows(kwords + kb + 2 * k[None, :], valid, MASKED)  # [NB, D/4]: classes 0, 1
    kwb = load_rows(kwords + kb + 2 * k[None, :] + 1, valid, MASKED)  # classes 2, 3
    lohi = load_rows(kwords + kb + D // 2, valid, MASKED)  # [NB, 1]
    m0, s0, m1, s1, m2, s2, m3, s3 = block_key_ranges(kwa, kwb, lohi)  # [NB, 1, D/4] each
    if BIASED:  # the high classes' codes come 16 times over (lane_codes)
        s1, s3 = s1 * 0.0625, s3 * 0.0625
    # q . k = sum_c q_c min_c + sum_c (q_c scale_c) code_c: each block's ranges scale its own copy
    # of the queries, [NB, D/4, R] a class, and the codes go into the dots as they are
    q0, q1, q2, q3 = qs  # [1, R, D/4] fp32
    w0, w1, w2, w3 = block_query(q0, s0, DOT), block_query(q1, s1, DOT), block_query(q2, s2, DOT), block_query(q3, s3, DOT)
    k0, k1, k2, k3 = lane_codes(kx, ASM, BIASED)
    if BIASED:  # the codes carry 1024 (lane_codes): the dots start from -1024 times their right operands' sums
        # NOTE: as dots against a constant, which leave the bias in the scores' layout; summed across
        # the lanes and added after (as the minima are), it cost 5-30 instructions more a tile (Triton 3.6)
        one = tl.full(kx.shape, -1024.0, DOT)
        x = tl.dot(one, w0, input_precision=PREC)
        x = tl.dot(one, w1, x, input_precision=PREC)
        x = tl.dot(one, w2, x, input_precision=PREC)
        x = tl.dot(one, w3, x, input_precision=PREC)
        x = tl.dot(k0.to(DOT), w0, x, input_precision=PREC)
    else:
        x = tl.dot(k0.to(DOT), w0, input_precision=PREC)
    x = tl.dot(k1.to(DOT), w1, x, input_precision=PREC)
    x = tl.dot(k2.to(DOT), w2, x, input_precision=PREC)
    x = tl.dot(k3.to(DOT), w3, x, input_precision=PREC)
    qm = q0 * m0 + q1 * m1 + q2 * m2 + q3 * m3
    x = x + tl.sum(qm, axis=2)[:, None, :]  # [NB, BS, R]
    if MASKED:
        x = tl.where(last_dim(valid), x, float("-inf"))
    # NOTE: the denominators and the sums of p_t min_t stay per token, [NB, BS, R], summed over the
    # tokens once at the end: two sums fewer a group and tile across the lanes that hold a token each
    m_new = tl.maximum(mw, tl.max(x, axis=1))
    alpha = tl.exp2(mw - m_new)[:, None, :]
    p = tl.exp2(x - m_new[:, None, :])
    lw = lw * alpha + p
    # values: each group of GV channels its own weights, p * its tokens' scales (class_values_t)
    vrow = s_dc + row
    j = tl.arange(0, GV // 4)[None, :, None]
    vm = blk * s_vmn + off * s_vmb + h * s_vmh  # [NB, BS]: each token's first (scale, min) word
    vx = load_rows(lanes + vrow[:, None, :] + j, valid[:, None, :], MASKED)  # [NB, GV/4, BS]: the lanes transposed
    vs, vn = half_pair(load_rows(vwords + vm, valid, MASKED))
    a0, a1, a2, a3 = group_values(p, vx, vs, a0, a1, a2, a3, alpha, ASM, DOT, PREC, BIASED)
    b0 = b0 * alpha + p * last_dim(vn)
    if D // GV == 2:
        vx = load_rows(lanes + vrow[:, None, :] + j + GV // 4, valid[:, None, :], MASKED)
        vs, vn = half_pair(load_rows(vwords + vm + 1, valid, MASKED))
        c0, c1, c2, c3 = group_values(p, vx, vs, c0, c1, c2, c3, alpha, ASM, DOT, PREC, BIASED)
        b1 = b1 * alpha + p * last_dim(vn)
    return blk_n, m_new, lw, a0, a1, a2, a3, c0, c1, c2, c3, b0, b1


@triton.jit
def group_values(p, vx, vs, a0, a1, a2, a3, alpha, ASM: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                 BIASED: tl.constexpr):
    """Class accumulators ``[.., n, R]`` (a value group's channels, n of each class, down the rows)
    rescaled by ``alpha`` [.., 1, R] and advanced by the weights ``p`` [.., T, R] times the tokens'
    scales ``vs`` [.., T] over the lanes ``vx`` [.., n, T] (``class_values_t`` without the minima)."""
    # NOTE: multiplied in DOT: fp16 pairs (HMUL2) on CUDA, not fp32 products each converted (Triton 3.6:
    # 8-21 instructions fewer a tile). The weights round twice (p, then the product), within 2^-10 of
    # each together (p under 2^-14, fp16's subnormals: 2^-25 absolute), far below a code's step. DOT
    # is fp16 or fp32 here (code_args): in bf16 the scales would lose three bits.
    w = p.to(DOT) * last_dim(vs).to(DOT)
    # NOTE: the lanes come transposed (token_codes' VT) and convert in the dots' layout: codes
    # converted first and then transposed went through shared memory, four times the lanes' bytes
    v0, v1, v2, v3 = lane_codes(vx, ASM, BIASED)
    return class_dots((v0, v1, v2, v3), w, a0, a1, a2, a3, alpha, 1024.0 if BIASED else 0.0, True, False, ASM,
                      DOT, PREC)


@triton.jit
def int4_blocks_warp_loop(
    q_ptr, qrows, rmask,  # rows [R] at q_ptr + qrows (where rmask); decode only: not causal
    data_ptr, kmeta_ptr, vmeta_ptr, table, h, start, end,  # end: a multiple of BS (full blocks only)
    m_i, l_i, qk_scale,
    s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
    R: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, GV: tl.constexpr,
    DOT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr, BIASED: tl.constexpr,
):
    """INT4 (KIVI) decode over the full blocks in ``[start, end)``, a softmax per block slot of the
    tile (``TILE / BS`` slots, the dots batched over them, which Triton gives the warps in turn),
    merged once at the end (``int4_tokens_warp_loop``'s NOTE); returns ``(m_i, l_i, acc [R, D])``.
    Tokens run down the dots' rows, the query rows are their columns.

    Nothing is dequantized element by element. A block's keys share per-channel ranges, so
    ``q . k = sum_c q_c min_c + sum_c (q_c scale_c) code_c``: the ranges scale a copy of the
    queries (``block_query``: ``[D, R]`` a block, against the codes' ``[BS, D]``) and the codes go
    into the dots as they are (BIASED: ``lane_codes``' biased values, each block's score dots
    starting from dots of -1024 against the same scaled queries, which take the bias off). A
    token's values have a (scale, min) pair per group of GV channels, which fold into the weights
    as INT4R's one pair does (``group_values``), one set of
    weights and accumulators per group (``D / GV`` of 1 or 2). The data's strides (bytes) are even
    and ``k_meta``, ``v_meta`` word-aligned (``paged_decode.int4_lanes``)."""
    NB: tl.constexpr = TILE // BS
    q0, q1, q2, q3 = class_queries(q_ptr, qrows, rmask, D, tl.float32)
    # scores in log2 units
    qs = ((q0 * qk_scale)[None, :, :], (q1 * qk_scale)[None, :, :], (q2 * qk_scale)[None, :, :],
          (q3 * qk_scale)[None, :, :])
    zero = tl.zeros([NB, GV // 4, R], tl.float32)
    a0, a1, a2, a3, c0, c1, c2, c3 = zero, zero, zero, zero, zero, zero, zero, zero
    mw = tl.full([NB, R], -1.0e30, tl.float32)  # each slot's running max
    lw = tl.zeros([NB, BS, R], tl.float32)  # its denominator and sums of p_t min_t, a group each, per token
    b0 = tl.zeros([NB, BS, R], tl.float32)
    b1 = tl.zeros([NB, BS, R], tl.float32)
    ptrs = (data_ptr.to(tl.pointer_type(tl.int16)), kmeta_ptr.to(tl.pointer_type(tl.int32)),
            vmeta_ptr.to(tl.pointer_type(tl.int32)))
    # NOTE: the strides (bytes of data, 16-bit fields of metadata: all even, paged_decode.int4_lanes) in
    # the units the pointers read, lanes and words, once: a shift of each offset cost 11 instructions a tile
    strides = (s_dc >> 1, s_dn >> 1, s_db >> 1, s_dh >> 1, s_kmn >> 1, s_kmh >> 1, s_vmn >> 1, s_vmb >> 1, s_vmh >> 1)
    tb = (tl.arange(0, NB) * BS)[:, None]  # [NB, 1]: each slot's first token
    blk_n = next_blocks(table, start, end, tb, BS)  # NOTE: each tile's block ids load an iteration ahead
    # NOTE: as int4_tokens_tiles': whole tiles unmasked, the split's last one masked, once
    whole = start + tl.maximum(end - start, 0) // TILE * TILE  # NOTE: an idle split's end < start
    for s in range(start, whole, TILE):
        blk_n, mw, lw, a0, a1, a2, a3, c0, c1, c2, c3, b0, b1 = int4_blocks_tile(
            s, tb, blk_n, table, end, ptrs, strides, h, qs, mw, lw, a0, a1, a2, a3, c0, c1, c2, c3, b0, b1,
            TILE, BS, D, GV, DOT, PREC, ASM, False, BIASED)
    if whole < end:
        blk_n, mw, lw, a0, a1, a2, a3, c0, c1, c2, c3, b0, b1 = int4_blocks_tile(
            whole, tb, blk_n, table, end, ptrs, strides, h, qs, mw, lw, a0, a1, a2, a3, c0, c1, c2, c3, b0, b1,
            TILE, BS, D, GV, DOT, PREC, ASM, True, BIASED)
    a0, a1, a2, a3 = unbias(a0, a1, a2, a3, BIASED)
    if D // GV == 2:
        c0, c1, c2, c3 = unbias(c0, c1, c2, c3, BIASED)
        a0, a1, a2, a3 = join_groups(a0, c0), join_groups(a1, c1), join_groups(a2, c2), join_groups(a3, c3)
    m_out, l_out, acc, f = merge_warps(m_i, l_i, mw, tl.sum(lw, axis=1), a0, a1, a2, a3)
    bm = tl.sum(tl.sum(b0, axis=1) * f, axis=0)[:, None]
    if D // GV == 2:
        bm = tl.where(tl.arange(0, D)[None, :] < GV, bm, tl.sum(tl.sum(b1, axis=1) * f, axis=0)[:, None])
    return m_out, l_out, acc + bm


@triton.jit
def last_dim(x):
    """``x`` (rank 1 or 2) with a last dimension of 1 added."""
    return tl.expand_dims(x, len(x.shape))


@triton.jit
def swap_last(x):
    """``x`` (rank 2 or 3: batched over warps) with its last two dimensions swapped."""
    if len(x.shape) == 3:
        y = tl.permute(x, (0, 2, 1))
    else:
        y = tl.trans(x)
    return y


@triton.jit
def load_rows(ptr, valid, MASKED: tl.constexpr):
    """``tl.load(ptr)``, 0 where not ``valid`` (broadcast to ``ptr``'s shape) when MASKED."""
    if MASKED:
        x = tl.load(ptr, mask=valid, other=0)
    else:
        x = tl.load(ptr)
    return x


@triton.jit
def token_ptrs(data_ptr, kmeta_ptr, vmeta_ptr):
    """An INT4R cache's pointers as ``token_codes`` reads them: the data as bytes (keys) and 16-bit
    lanes (values), the metadata as 32-bit (scale, min) words."""
    return (data_ptr.to(tl.pointer_type(tl.int8)), data_ptr.to(tl.pointer_type(tl.int16)),
            kmeta_ptr.to(tl.pointer_type(tl.int32)), vmeta_ptr.to(tl.pointer_type(tl.int32)))


@triton.jit
def token_codes(kbytes, lanes, kwords, vwords, blk, off, valid, kc, vc, h,
                s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh, MASKED: tl.constexpr = True,
                VT: tl.constexpr = False):
    """INT4R tokens (block ids ``blk``, offsets ``off``, where ``valid``; any shape ``S``) of KV head
    ``h``: their key bytes ``[*S, D/2]`` (``kc``: the byte indices), value lanes ``[*S, D/4]`` (``vc``:
    the lane indices; both ``[*S, n]``-broadcastable; VT: the lanes transposed, ``[.., D/4, T]``
    from ``vc`` ``[.., D/4, 1]``), and their keys' and values' (scale, min) as fp32 ``[*S]``. Without
    MASKED every token is read (``valid`` unused)."""
    row = blk * s_dn + off * s_db + h * s_dh  # in bytes
    kb = load_rows(kbytes + last_dim(row) + kc, last_dim(valid), MASKED)
    # NOTE: >> 1, not // 2, on these non-negative offsets: a signed division costs a correction
    if VT:
        tok: tl.constexpr = len(row.shape) - 1
        vx = load_rows(lanes + tl.expand_dims((s_dc + row) >> 1, tok) + vc, tl.expand_dims(valid, tok), MASKED)
    else:
        vx = load_rows(lanes + last_dim((s_dc + row) >> 1) + vc, last_dim(valid), MASKED)
    ks, km = half_pair(load_rows(kwords + (((blk * s_kmn + h * s_kmh) >> 1) + off), valid, MASKED))
    vs, vm = half_pair(load_rows(vwords + ((blk * s_vmn + off * s_vmb + h * s_vmh) >> 1), valid, MASKED))
    return kb, vx, ks, km, vs, vm


# Four bytes of packed INT4 codes ($2; byte j: channel 2j in its low nibble, 2j + 1 in its high)
# -> the even channels' codes ($0) and the odd channels' ($1), four int8 codes a word each.
U4_BYTES = tl.constexpr("{ .reg .b32 u; shr.b32 u, $2, 4; and.b32 $0, $2, 0x0f0f0f0f; and.b32 $1, u, 0x0f0f0f0f; }")


@triton.jit
def byte_codes(x, ASM: tl.constexpr):
    """Bytes of packed INT4 codes (int8) -> the codes of their even channels and of their odd ones
    (int8 each), without a conversion. With ASM (CUDA only) a word of bytes takes three instructions."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(U4_BYTES, "=r,=r,r", [x], dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    else:
        lo = x & 15
        hi = (x >> 4) & 15
    return lo, hi


@triton.jit
def int8_codes(x, amax):
    """Rows ``x [R, n]`` (fp32) rounded to int8 steps of ``amax / 127`` (``amax [R]``: the rows'
    largest magnitudes, at least 127e-30), as fp32 (``llmbus.kernels.quant_reference.round_query``). NOTE:
    ``x * 127 / amax`` correctly rounded, not ``x * (127 / amax)``: a half-precision row's channel at
    half its largest magnitude lands on a tie (63.5), where an ulp of the reciprocal, or a fused
    multiply-add, would decide the rounding."""
    a = tl.broadcast_to(tl.maximum(amax, 127e-30)[:, None], x.shape)
    return tl.floor(tl.math.div_rn(x * 127.0, a) + 0.5)


@triton.jit
def int8_step(amax):
    """The step of ``int8_codes`` (correctly rounded; 1e-30 for an all-zero row)."""
    return tl.math.div_rn(tl.maximum(amax, 127e-30), tl.full(amax.shape, 127.0, tl.float32))


@triton.jit
def int8_rows(q):
    """Query rows ``[R, D]`` rounded to int8 (``int8_codes``): their codes (as fp32: exact in any dot
    dtype) and each row's step. INT4R attends with ``codes * step``."""
    x = q.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    return int8_codes(x, amax), int8_step(amax)


@triton.jit
def tile_query(q, qk_scale, FMT: tl.constexpr, DOT: tl.constexpr):
    """Query rows ``[R, D]`` as the kernels' whole-tile loads (``kv_tile.load_kv_tile``) meet them, in
    ``DOT``, and the scale of their scores (``[R, 1]`` or a scalar): INT4R's rounded to int8 as
    ``int4_tokens_loop`` rounds them (the codes, each row's step joining ``qk_scale``), others as
    they are."""
    scale = qk_scale
    if FMT == 3:
        q, step = int8_rows(q)
        scale = (step * qk_scale)[:, None]
    return q.to(DOT), scale


@triton.jit
def query_bytes(q_ptr, qrows, rmask, D: tl.constexpr):
    """The query rows (``q_ptr + qrows``, where ``rmask``) rounded to int8 (``int8_rows``): their
    even and their odd channels (``[R, D/2]`` int8 each), each row's step, and the sum of its codes."""
    # NOTE: whole rows, split by channel parity in registers: two strided loads of the parities
    # gave the rows a column-major layout, which Triton 3.6 then fed the key dots byte by byte
    x = tl.load(q_ptr + qrows[:, None] + tl.arange(0, D)[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    codes = int8_codes(x, amax)
    qe, qo = tl.split(tl.reshape(codes, [codes.shape[0], D // 2, 2]))
    return qe.to(tl.int8), qo.to(tl.int8), int8_step(amax), tl.sum(codes, axis=1)


@triton.jit
def byte_scores(qe, qo, qsum, kb, ks, km, ASM: tl.constexpr):
    """Scores ``[.., R, T]`` in units of the rows' steps (unscaled by ``qk_scale``): the int8 queries'
    even and odd channels (``[.., R, D/2]``) against the key bytes ``kb`` [.., T, D/2] in integer dots,
    each token's pair (``ks``, ``km`` [.., T]) folded in: ``scale * (q . code) + min * sum(q)``
    (``qsum`` [R]: the rows' code sums)."""
    k0, k1 = byte_codes(kb, ASM)
    acc = tl.dot(qe, swap_last(k0), out_dtype=tl.int32)
    acc = tl.dot(qo, swap_last(k1), acc, out_dtype=tl.int32)
    last: tl.constexpr = len(ks.shape) - 1
    return acc.to(tl.float32) * tl.expand_dims(ks, last) + last_dim(qsum) * tl.expand_dims(km, last)


@triton.jit
def byte_scores_t(qe, qo, qsum, kb, ks, km, ASM: tl.constexpr):
    """``byte_scores`` with tokens down the rows: ``[.., T, R]`` from the queries' even and odd
    channels as columns (``[.., D/2, R]``). The codes are the dots' left operands, so a dot's 16
    rows are 16 tokens and the rows ``R`` need only 8 columns (``int4_tokens_warp_loop``)."""
    k0, k1 = byte_codes(kb, ASM)
    acc = tl.dot(k0, qe, out_dtype=tl.int32)
    acc = tl.dot(k1, qo, acc, out_dtype=tl.int32)
    return acc.to(tl.float32) * last_dim(ks) + last_dim(km) * qsum


@triton.jit
def class_dots(codes, w, a0, a1, a2, a3, ae, BIAS: tl.constexpr, CODES_LEFT: tl.constexpr, WORDS: tl.constexpr,
               ASM: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """The four class accumulators rescaled by ``ae`` and advanced by their codes' dots with the
    weights ``w``, the codes the left operands with CODES_LEFT, else the right: ``codes`` INT8
    words (WORDS: each dot converts its class as it goes, which keeps fewer registers live) or a
    tuple of the four classes. BIAS (0: the codes are exact): the codes carry it, and each dot
    starts from its accumulator less the tile's bias, ``BIAS * sum_t w_t`` (one more dot, against
    a constant), so the accumulators never hold more than a tile's bias: tensor cores truncate
    what they add, and a bias carried over a long split would grow the error with it."""
    c0 = class_code(codes, 0, WORDS, BIAS, ASM, DOT)
    if BIAS != 0:
        one = tl.full(c0.shape, BIAS, DOT)
        t = tl.dot(one, w, input_precision=PREC) if CODES_LEFT else tl.dot(w, one, input_precision=PREC)
        a0 = class_dot(c0, w, a0 * ae - t, CODES_LEFT, PREC)
        a1 = class_dot(class_code(codes, 1, WORDS, BIAS, ASM, DOT), w, a1 * ae - t, CODES_LEFT, PREC)
        a2 = class_dot(class_code(codes, 2, WORDS, BIAS, ASM, DOT), w, a2 * ae - t, CODES_LEFT, PREC)
        a3 = class_dot(class_code(codes, 3, WORDS, BIAS, ASM, DOT), w, a3 * ae - t, CODES_LEFT, PREC)
    else:
        a0 = a0 * ae + class_dot(c0, w, None, CODES_LEFT, PREC)
        a1 = a1 * ae + class_dot(class_code(codes, 1, WORDS, BIAS, ASM, DOT), w, None, CODES_LEFT, PREC)
        a2 = a2 * ae + class_dot(class_code(codes, 2, WORDS, BIAS, ASM, DOT), w, None, CODES_LEFT, PREC)
        a3 = a3 * ae + class_dot(class_code(codes, 3, WORDS, BIAS, ASM, DOT), w, None, CODES_LEFT, PREC)
    return a0, a1, a2, a3


@triton.jit
def class_code(codes, k: tl.constexpr, WORDS: tl.constexpr, BIAS: tl.constexpr, ASM: tl.constexpr, DOT: tl.constexpr):
    """Class ``k`` of ``class_dots``' codes in the dots' dtype."""
    if WORDS:
        return word_codes(codes, 8 * k, ASM, BIAS != 0).to(DOT)
    else:
        return codes[k].to(DOT)


@triton.jit
def class_dot(c, w, acc, CODES_LEFT: tl.constexpr, PREC: tl.constexpr):
    """``c . w`` (CODES_LEFT) or ``w . c``, added to ``acc`` (None: zeros)."""
    if CODES_LEFT:
        return tl.dot(c, w, acc, input_precision=PREC)
    else:
        return tl.dot(w, c, acc, input_precision=PREC)


@triton.jit
def class_values_t(p, vx, vs, vm, a0, a1, a2, a3, b, alpha, ASM: tl.constexpr, DOT: tl.constexpr,
                   PREC: tl.constexpr, BIASED: tl.constexpr):
    """``class_values`` with tokens down the rows: weights ``p`` [.., T, R], accumulators
    ``[.., D/4, R]`` (each class's channels down the rows), ``b``, ``alpha`` [.., R]. The value codes
    are the left operands (``[.., D/4, T]``, the lanes transposed), the weights the right."""
    tok: tl.constexpr = len(p.shape) - 2
    a0, a1, a2, a3 = group_values(p, vx, vs, a0, a1, a2, a3, tl.expand_dims(alpha, tok), ASM, DOT, PREC, BIASED)
    return a0, a1, a2, a3, b * alpha + tl.sum(p * last_dim(vm), axis=tok)


@triton.jit
def class_values(p, vx, vs, vm, a0, a1, a2, a3, b, alpha, ASM: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                 BIASED: tl.constexpr):
    """The class accumulators ``[.., R, D/4]`` and the sums ``b = sum_t p_t min_t`` ``[.., R]``,
    rescaled by ``alpha`` [.., R] and advanced by the weights ``p`` [.., R, T] over the codes (lanes
    ``vx`` [.., T, D/4]), each token's pair (``vs``, ``vm`` [.., T]) folded in:
    ``(p * scale) . code`` and ``sum_t p_t min_t``. BIASED (fp16 dots): the codes come biased by
    1024 (``lane_codes``), taken off tile by tile (``class_dots``). The high classes come 16 times
    over (``unbias``)."""
    last: tl.constexpr = len(p.shape) - 1
    w = (p * tl.expand_dims(vs, last - 1)).to(DOT)
    v0, v1, v2, v3 = lane_codes(vx, ASM, BIASED)
    a0, a1, a2, a3 = class_dots((v0, v1, v2, v3), w, a0, a1, a2, a3, last_dim(alpha), 1024.0 if BIASED else 0.0,
                                False, False, ASM, DOT, PREC)
    return a0, a1, a2, a3, b * alpha + tl.sum(p * tl.expand_dims(vm, last - 1), axis=last)


@triton.jit
def scaled_softmax_step(x, m_i, l_i, cs, TOK: tl.constexpr):
    """``softmax_step`` over scores ``x`` whose tokens run along axis ``TOK`` (the rows' state,
    ``m_i``, ``l_i``, has that axis removed), in units of ``cs`` (> 0, per row: the state's shape,
    or broadcast to it) folded into the exponent's one multiply-add."""
    m_new = tl.maximum(m_i, tl.max(x, axis=TOK) * cs)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(x * tl.expand_dims(cs, TOK) - tl.expand_dims(m_new, TOK))
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=TOK)


@triton.jit
def merge_warps(m_i, l_i, mw, lw, a0, a1, a2, a3):
    """The per-warp loops' states (``mw``, ``lw`` [NW, R], class accumulators ``[NW, D/4, R]``)
    merged with the one passed in (``m_i``, ``l_i`` [R], whose accumulator is zero): the merged
    max, denominator and accumulator ``[R, D]``, and each warp's factor ``f`` [NW, R]."""
    m_out = tl.maximum(m_i, tl.max(mw, axis=0))
    f = tl.exp2(mw - m_out[None, :])
    l_out = l_i * tl.exp2(m_i - m_out) + tl.sum(lw * f, axis=0)
    f3 = f[:, None, :]
    acc = join_classes(tl.trans(tl.sum(a0 * f3, axis=0)), tl.trans(tl.sum(a1 * f3, axis=0)),
                       tl.trans(tl.sum(a2 * f3, axis=0)), tl.trans(tl.sum(a3 * f3, axis=0)))
    return m_out, l_out, acc, f


@triton.jit
def int4_tokens_loop(
    q_ptr, qrows, rmask, qpos,  # rows [R] at q_ptr + qrows (where rmask); CAUSAL: each row's position
    data_ptr, kmeta_ptr, vmeta_ptr, table, h, start, end,  # end: a multiple of BS (full blocks only)
    m_i, l_i, qk_scale,
    s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
    R: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    DOT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr, CAUSAL: tl.constexpr,
    BIASED: tl.constexpr,  # the value codes biased (lane_codes; paged_decode.BIASED_VALUES)
):
    """INT4R attention over the full blocks in ``[start, end)`` from the initial state ``m_i``,
    ``l_i``; returns ``(m_i, l_i, acc [R, D])``. Each token's keys and values have one (scale,
    min) pair each (``llmbus.kv.formats``), which fold into the tile's scores and weights, as
    INT8's scales do, so the codes go into the dots as they are:
    ``q . (min + scale * code) = scale * (q . code) + min * sum(q)``, and
    ``sum_t p_t (min_t + scale_t * code_t) = (p scale) . code + sum_t p_t min_t``.
    The queries are rounded to int8 (``query_bytes``), so the key dots are integer ones (IMMA on
    CUDA, twice fp16's rate) over the codes as bytes split by channel parity (``byte_codes``: three
    instructions a word where fp16 codes take nine), and each row's step joins ``qk_scale`` in the
    exponent. The values' codes are read as 16-bit lanes by channel class (``lane_codes``). The
    data's strides (bytes) are even and the metadata word-aligned (``paged_decode.int4_lanes``)."""
    kc = tl.arange(0, D // 2)[None, :]
    vc = tl.arange(0, D // 4)[None, :]
    qe, qo, step, qsum = query_bytes(q_ptr, qrows, rmask, D)
    cs = tl.maximum(step * qk_scale, 1e-30)  # a score unit in the exponent's (log2) units, per row (> 0)
    a0, a1, a2, a3 = class_accumulators(R, D)
    b = tl.zeros([R], tl.float32)  # sum_t p_t min_t, rescaled as the accumulators are
    ptrs = token_ptrs(data_ptr, kmeta_ptr, vmeta_ptr)
    strides = (s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh)
    m_i, l_i, a0, a1, a2, a3, b = int4_tokens_tiles(
        start, end, tl.arange(0, TILE), table, ptrs, strides, kc, vc, h, qe, qo, qsum, cs, qpos,
        m_i, l_i, a0, a1, a2, a3, b, TILE, BS, DOT, PREC, ASM, CAUSAL, BIASED, False)
    a0, a1, a2, a3 = unbias(a0, a1, a2, a3, BIASED)
    return m_i, l_i, join_classes(a0, a1, a2, a3) + b[:, None]


@triton.jit
def int4_tokens_tiles(start, end, t, table, ptrs, strides, kc, vc, h, qe, qo, qsum, cs, qpos,
                      m_i, l_i, a0, a1, a2, a3, b,
                      TILE: tl.constexpr, BS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                      ASM: tl.constexpr, CAUSAL: tl.constexpr, BIASED: tl.constexpr, SWAP: tl.constexpr):
    """``int4_tokens_tile`` over the tiles of ``[start, end)`` (``t``: a tile's token offsets,
    ``[TILE]`` or split between warps ``[NW, TILE / NW]``); returns the state."""
    # NOTE: each tile's block ids are loaded one iteration ahead (``next_blocks``)
    blk_n = next_blocks(table, start, end, t, BS)
    if CAUSAL:
        for s in range(start, end, TILE):
            blk_n, m_i, l_i, a0, a1, a2, a3, b = int4_tokens_tile(
                s, t, blk_n, table, end, ptrs, strides, kc, vc, h, qe, qo, qsum, cs, qpos,
                m_i, l_i, a0, a1, a2, a3, b, TILE, BS, DOT, PREC, ASM, CAUSAL, True, BIASED, SWAP)
    else:
        # NOTE: a decode's tiles are whole but its split's last: they read and score every token
        # unmasked (the masks and selects were a tenth of the loop's instructions), the last one
        # masked, once
        whole = start + tl.maximum(end - start, 0) // TILE * TILE  # NOTE: an idle split's end < start
        for s in range(start, whole, TILE):
            blk_n, m_i, l_i, a0, a1, a2, a3, b = int4_tokens_tile(
                s, t, blk_n, table, end, ptrs, strides, kc, vc, h, qe, qo, qsum, cs, qpos,
                m_i, l_i, a0, a1, a2, a3, b, TILE, BS, DOT, PREC, ASM, CAUSAL, False, BIASED, SWAP)
        if whole < end:
            blk_n, m_i, l_i, a0, a1, a2, a3, b = int4_tokens_tile(
                whole, t, blk_n, table, end, ptrs, strides, kc, vc, h, qe, qo, qsum, cs, qpos,
                m_i, l_i, a0, a1, a2, a3, b, TILE, BS, DOT, PREC, ASM, CAUSAL, True, BIASED, SWAP)
    return m_i, l_i, a0, a1, a2, a3, b


@triton.jit
def int4_tokens_tile(s, t, blk_n, table, end, ptrs, strides, kc, vc, h, qe, qo, qsum, cs, qpos,
                     m_i, l_i, a0, a1, a2, a3, b,
                     TILE: tl.constexpr, BS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                     ASM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, BIASED: tl.constexpr,
                     SWAP: tl.constexpr):
    """One tile of ``int4_tokens_loop`` (tokens ``s + t``): the next tile's block ids and the
    updated state. Without MASKED every token of the tile is below ``end``. SWAP (not CAUSAL): the
    scores come with tokens down the rows (``byte_scores_t``, ``class_values_t``)."""
    kbytes, lanes, kwords, vwords = ptrs
    s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh = strides
    valid, blk, off, blk_n = tile_rows(blk_n, table, s, end, t, TILE, BS)
    kb, vx, ks, km, vs, vm = token_codes(kbytes, lanes, kwords, vwords, blk, off, valid, kc, vc, h,
                                         s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh, MASKED, SWAP)
    if SWAP:
        x = byte_scores_t(qe, qo, qsum, kb, ks, km, ASM)
        if MASKED:
            x = tl.where(last_dim(valid), x, float("-inf"))
        tok: tl.constexpr = len(x.shape) - 2
    else:
        x = byte_scores(qe, qo, qsum, kb, ks, km, ASM)
        if MASKED:
            x = tl.where(row_mask(s + t, valid, qpos, CAUSAL), x, float("-inf"))
        tok: tl.constexpr = len(x.shape) - 1
    m_new, alpha, p, l_i = scaled_softmax_step(x, m_i, l_i, cs, tok)
    if SWAP:
        a0, a1, a2, a3, b = class_values_t(p, vx, vs, vm, a0, a1, a2, a3, b, alpha, ASM, DOT, PREC, BIASED)
    else:
        a0, a1, a2, a3, b = class_values(p, vx, vs, vm, a0, a1, a2, a3, b, alpha, ASM, DOT, PREC, BIASED)
    return blk_n, m_new, l_i, a0, a1, a2, a3, b


@triton.jit
def int4_tokens_warp_loop(
    q_ptr, qrows, rmask,  # as int4_tokens_loop's
    data_ptr, kmeta_ptr, vmeta_ptr, table, h, start, end,
    m_i, l_i, qk_scale,
    s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh,
    R: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    DOT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr, BIASED: tl.constexpr,
    NW: tl.constexpr,  # the launch's warps: each takes TILE / NW tokens of a tile
):
    """``int4_tokens_loop`` with each warp its own online softmax over its own share of every tile
    (the dots batched over the warps, which Triton gives a warp each), merged once at the end.
    NOTE: the 2-D loop's warps split a tile's tokens between them, so each row's max and sum cross
    the warps (shared memory and a barrier, twice a tile) and the weights go through shared memory
    to the value dots, which need every token; here neither does, at the cost of a whole
    accumulator a warp, rescaled every tile.

    Tokens run down the rows (``[NW, TILE / NW, R]`` scores, ``[NW, D/4, R]`` accumulators): the
    codes are the dots' left operands, whose 16 rows a ``mma`` fills with tokens, and the query
    rows are the right operands' columns, of which a ``mma`` takes 8. With the query rows down the
    dots' rows instead (``R`` = 16 for any GQA group up to 16), a group of 4 left three quarters of
    every score, weight and accumulator element padding (``paged_decode``'s GP is the group's power
    of two here).
    INT4R decode's default (``paged_decode.WARP_TILES``), not yet timed on a GPU."""
    TW: tl.constexpr = TILE // NW
    kc = tl.arange(0, D // 2)[None, None, :]
    vc = tl.arange(0, D // 4)[None, :, None]  # the lanes transposed (token_codes' VT)
    qe, qo, step, qsum = query_bytes(q_ptr, qrows, rmask, D)
    cs = tl.maximum(step * qk_scale, 1e-30)[None, :]
    qe = tl.broadcast_to(tl.trans(qe)[None, :, :], [NW, D // 2, R])
    qo = tl.broadcast_to(tl.trans(qo)[None, :, :], [NW, D // 2, R])
    zero = tl.zeros([NW, D // 4, R], tl.float32)
    a0, a1, a2, a3 = zero, zero, zero, zero
    mw = tl.full([NW, R], -1.0e30, tl.float32)  # each warp's running max, denominator, sum_t p_t min_t
    lw = tl.zeros([NW, R], tl.float32)
    bw = tl.zeros([NW, R], tl.float32)
    ptrs = token_ptrs(data_ptr, kmeta_ptr, vmeta_ptr)
    strides = (s_dc, s_dn, s_db, s_dh, s_kmn, s_kmh, s_vmn, s_vmb, s_vmh)
    t = tl.reshape(tl.arange(0, TILE), [NW, TW])  # warp w takes tokens w * TW + j
    mw, lw, a0, a1, a2, a3, bw = int4_tokens_tiles(  # decode only: not causal (no query positions)
        start, end, t, table, ptrs, strides, kc, vc, h, qe, qo, qsum, cs, None,
        mw, lw, a0, a1, a2, a3, bw, TILE, BS, DOT, PREC, ASM, False, BIASED, True)
    a0, a1, a2, a3 = unbias(a0, a1, a2, a3, BIASED)
    m_out, l_out, acc, f = merge_warps(m_i, l_i, mw, lw, a0, a1, a2, a3)
    return m_out, l_out, acc + tl.sum(bw * f, axis=0)[:, None]
