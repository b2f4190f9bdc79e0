"""Triton kernels for a decoder layer's element-wise glue on CUDA: RMSNorm with the residual add
fused in, rotary embedding in place, and SiLU-and-multiply.

Written in torch, each layer's glue is ~25 launches (RMSNorm alone is eight: cast, square, mean,
add, rsqrt, multiply, cast, scale); at small batch a GPU step is bound by launches, and even
replayed as a CUDA graph each tiny kernel costs the GPU a few microseconds. These make it four a
layer. Each rounds where the torch code (``llmbus.model.llama``, HF's order) rounds;
``llmbus.kernels.reference`` has the torch statements they are tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, s_x, s_res, s_out, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        # the model dtype's sum, as ``h + f(h)`` in torch (fp32 holds the exact sum's rounding)
        x = (x.to(tl.float32) + tl.load(res_ptr + row * s_res + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * s_res + cols, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # weight * h.to(dtype): h rounds to the model dtype first
    out = w * h.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * s_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``RMSNorm(x)`` of ``x [T, N]``; with ``residual`` (``[T, N]``, the model dtype), first
    ``residual += x`` in place and the norm of that sum: the layer's ``h + f(h)`` and the next
    norm in one pass. Returns a new ``[T, N]`` tensor."""
    t, n = x.shape
    if x.stride(-1) != 1 or (residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1)):
        raise ValueError("rms_norm needs rows of unit stride (and a residual shaped like x)")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if t:
        block = triton.next_power_of_2(n)
        res = residual if residual is not None else x
        _rms_norm_kernel[(t,)](x, res, weight, out, n, x.stride(0), res.stride(0), out.stride(0), eps,
                               HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))  # fmt: skip
    return out


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, s_t, s_h, s_cos, s_sin, n_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (d < HALF)
    first = x_ptr + t * s_t + heads * s_h + d
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * s_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * s_sin + d, mask=d < HALF, other=0.0).to(tl.float32)
    # each product rounds to the model dtype before the sum, as torch's ops round (on the H200
    # outputs still differed from torch's by an ulp now and then: tests bound it)
    dt = x_ptr.dtype.element_ty
    a, b = (x1 * c).to(dt).to(tl.float32), (x2 * s).to(dt).to(tl.float32)
    e, f = (x2 * c).to(dt).to(tl.float32), (x1 * s).to(dt).to(tl.float32)
    tl.store(first, (a - b).to(dt), mask=mask)
    tl.store(first + HALF, (e + f).to(dt), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` in place (``x * cos + rotate_half(x) * sin``, the halves' form of
    ``llmbus.kernels.reference.rotary``) by ``cos``/``sin [T, 1, D/2]``; ``x`` may be a strided view
    (the q and k heads inside the qkv projection's output). Returns ``x``."""
    t, h, d = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or d % 2:
        raise ValueError("rotary_ needs an even head size and unit-stride rows")
    if cos.shape[0] != t or sin.shape[0] != t or cos.shape[-1] != d // 2 or sin.shape[-1] != d // 2:
        raise ValueError(f"rotary_ needs cos and sin of [{t}, 1, {d // 2}], got {list(cos.shape)}, {list(sin.shape)}")
    if t:
        half = d // 2
        block_h = min(triton.next_power_of_2(h), max(1, 4096 // triton.next_power_of_2(half)))
        _rotary_kernel[(t, triton.cdiv(h, block_h))](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), h,
                                                     HALF=half, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(half))  # fmt: skip
    return x


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, s_x, s_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    # silu(gate) rounds to the model dtype, then the product does (torch's two ops)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * s_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2I]`` (gate the first half): ``[T, I]``."""
    t, two_i = gate_up.shape
    if gate_up.stride(-1) != 1 or two_i % 2:
        raise ValueError("silu_mul needs unit-stride rows of even width")
    n = two_i // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out
