"""Triton split-K reduction for paged decode: combine per-split partial softmax results.

Split ``s`` of a (sequence, head) left an unnormalized accumulator ``acc_s``, its running max
``m_s`` (log2 units) and denominator ``l_s``; the output is
``sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s`` with ``M = max_s m_s`` (zeros when every
split was empty).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# NOTE: S, the split count, follows the longest context (llmbus.kernels.paged_decode.choose_splits, at
# most 64): a runtime value, and the block SP is 64 for any S up to it, so a serving run compiles
# one variant, not one per count (the masked lanes cost next to nothing)
@triton.jit(do_not_specialize=["S"])
def reduce_splits_kernel(
    part_ptr,  # fp32 [B, Hq, S, D] contiguous
    ml_ptr,  # fp32 [B, Hq, S, 2] contiguous
    out_ptr,  # [B, Hq, D]
    s_ob, s_oh,
    S, SP: tl.constexpr, D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hq = tl.num_programs(1)
    sp = tl.arange(0, SP)
    smask = sp < S
    base = (b * hq + h) * S
    m = tl.load(ml_ptr + (base + sp) * 2, mask=smask, other=-1.0e30)
    l = tl.load(ml_ptr + (base + sp) * 2 + 1, mask=smask, other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))
    acc = tl.load(part_ptr + (base + sp)[:, None] * D + tl.arange(0, D)[None, :], mask=smask[:, None], other=0.0)
    den = tl.sum(w * l, axis=0)
    res = tl.sum(w[:, None] * acc, axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + tl.arange(0, D), res.to(out_ptr.dtype.element_ty))


def reduce_splits(part: torch.Tensor, ml: torch.Tensor, out: torch.Tensor) -> None:
    """Launch ``reduce_splits_kernel`` into ``out [B, Hq, D]``."""
    b, hq, s, d = part.shape
    if not (part.is_contiguous() and ml.is_contiguous() and ml.shape == (b, hq, s, 2)):
        raise ValueError("partials must be contiguous fp32 [B, Hq, S, D] and [B, Hq, S, 2]")
    if out.shape != (b, hq, d) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{b}, {hq}, {d}] contiguous in D")
    reduce_splits_kernel[(b, hq)](part, ml, out, out.stride(0), out.stride(1), S=s, SP=max(64, triton.next_power_of_2(s)), D=d)
