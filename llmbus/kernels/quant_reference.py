"""Pure-torch INT8 / INT4 quantization of KV rows and blocks: the definition the kernels follow.

Encodings are documented in ``llmbus.kv.formats``. Every function computes in fp32 and rounds
half up (``floor(x + 0.5)``) so the Triton kernels can match it operation for operation.
Stored scales and minimums are rounded to fp16 *before* the integers are computed from them, so
dequantization uses exactly the numbers quantization used.
"""

from __future__ import annotations

import functools
import math

import torch

INT8_MAX = 127.0
INT4_MAX = 15.0
CODE_MAX = 255.0
# NOTE: the per-head key range is widened by this relative margin before rounding to fp16, so the
# rounded range still covers every value.
RANGE_PAD = 2.0**-9


def _round(x: torch.Tensor) -> torch.Tensor:
    return torch.floor(x + 0.5)


def _safe_div(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.where(s > 0, x / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(x))


# -- INT8, symmetric per row ---------------------------------------------------------------------
def int8_quantize(x: torch.Tensor, scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> ``(q int8 [..., D], scale [...])`` with ``x ~= q * scale``."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).to(scale_dtype)
    q = _round(_safe_div(xf, scale.float()[..., None])).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def int8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[..., None]


# -- INT4, asymmetric per row in channel groups --------------------------------------------------
def int4_group_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> ``(q uint8 [..., D] in 0..15, scale fp16 [..., D/group], min fp16 [..., D/group])``."""
    xf = x.float().unflatten(-1, (-1, group))
    mn = xf.amin(dim=-1).half()
    scale = ((xf.amax(dim=-1) - mn.float()) / INT4_MAX).half()
    q = _round(_safe_div(xf - mn.float()[..., None], scale.float()[..., None])).clamp(0, INT4_MAX)
    return q.flatten(-2).to(torch.uint8), scale, mn


def int4_group_dequantize(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group: int) -> torch.Tensor:
    qf = q.float().unflatten(-1, (-1, group))
    return (mn.float()[..., None] + qf * scale.float()[..., None]).flatten(-2)


# -- INT4 keys of a full block, per channel with two-level ranges --------------------------------
def int4_key_block_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys of one full block ``x [bs, H, D]`` -> ``(q uint8 [bs, H, D], codes int16 [H, D], lo fp16 [H], hi fp16 [H])``.

    Channel ``c`` of head ``h`` is quantized over the block's tokens on the range
    ``[lo + m * step, lo + M * step]``, ``step = (hi - lo) / 255``, where the 8-bit codes ``m``
    (floor) and ``M`` (ceil) are packed as ``m | M << 8``."""
    xf = x.float()
    lo, hi = xf.amin(dim=(0, 2)), xf.amax(dim=(0, 2))
    lo16 = (lo - lo.abs() * RANGE_PAD).half()
    hi16 = (hi + hi.abs() * RANGE_PAD).half()
    lo_f = lo16.float()[:, None]
    step = (hi16.float()[:, None] - lo_f) / CODE_MAX  # [H, 1]
    m = torch.floor(_safe_div(xf.amin(dim=0) - lo_f, step)).clamp(0, CODE_MAX)
    big = torch.ceil(_safe_div(xf.amax(dim=0) - lo_f, step)).clamp(0, CODE_MAX)
    cmin, cscale = _channel_params(m, big, lo_f, step)
    q = _round(_safe_div(xf - cmin, cscale)).clamp(0, INT4_MAX)
    codes = (m.to(torch.int32) | (big.to(torch.int32) << 8)).to(torch.int16)
    return q.to(torch.uint8), codes, lo16, hi16


def _channel_params(m, big, lo_f, step):
    cmin = lo_f + m * step
    cscale = (big - m) * step / INT4_MAX
    return cmin, cscale


def int4_key_block_dequantize(q: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Inverse of ``int4_key_block_quantize``: ``[..., bs, H, D]`` fp32 (leading block dims allowed)."""
    c = codes.to(torch.int32) & 0xFFFF
    m, big = (c & 0xFF).float(), ((c >> 8) & 0xFF).float()
    lo_f = lo.float()[..., None]
    step = (hi.float()[..., None] - lo_f) / CODE_MAX
    cmin, cscale = _channel_params(m, big, lo_f, step)
    return cmin.unsqueeze(-3) + q.float() * cscale.unsqueeze(-3)


# -- INT4R's rotation ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _hadamard(d: int, device: torch.device) -> torch.Tensor:
    # NOTE: built outside inference mode, which the engine's steps run in: a cached inference
    # tensor could not be saved for backward by a later rotate() that autograd records
    with torch.inference_mode(False):
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        return (h / d**0.5).float().to(device)


def hadamard(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal ``d x d`` Hadamard matrix (Sylvester's, scaled by ``1/sqrt(d)``; symmetric,
    its own inverse), fp32; ``d`` a power of two."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {d}")
    return _hadamard(d, torch.device(device))


def rotation_scale(d: int) -> float:
    """The fp32 factor that makes ``d``'s butterflies orthonormal: ``1 / sqrt(d)`` (as the matrix's entries)."""
    return float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32))  # NOTE: sqrt, as the C kernels take it


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` times the Hadamard matrix (``hadamard``), returned in ``x``'s dtype: how INT4R
    stores keys and meets them with queries. Rotating twice gives ``x`` back. Computed in fp32 as the
    fast Walsh-Hadamard transform defines it: stages h = 1, 2, 4, .. D/2, each turning every pair
    ``(x_j, x_{j+h})`` (j in the lower half of its run of 2h) into ``(x_j + x_{j+h}, x_j - x_{j+h})``,
    then times ``rotation_scale``. NOTE: these roundings are the definition, so the C kernels
    (``cpu_native.rotate``, the fused decode layers) give the same bits; a matrix product's sums
    would round by its library's order."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {d}")
    y = x.float()
    h = 1
    while h < d:
        y = y.unflatten(-1, (d // (2 * h), 2, h))
        a, b = y.select(-2, 0), y.select(-2, 1)
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * rotation_scale(d)).to(x.dtype)


def round_query(q: torch.Tensor) -> torch.Tensor:
    """``q [..., D]`` rounded to int8 symmetrically per row and back, fp32: how INT4R attends (its
    kernels' key dots are integer ones: ``llmbus.kernels.decode_tiles.int4_tokens_loop``). Codes are
    ``floor(q * 127 / amax + 0.5)``, the division correctly rounded (a tie, common in half-precision
    rows, comes out the same everywhere); the rounding adds at most amax / 254 a channel, little
    beside INT4 keys' error."""
    x = q.float()
    amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(INT8_MAX * 1e-30)  # an all-zero row: step 1e-30
    return _round((x * INT8_MAX) / amax) * (amax / INT8_MAX)


# -- nibble packing ------------------------------------------------------------------------------
def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., D]`` (values 0..15) -> ``uint8 [..., D/2]``, even channel in the low nibble."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)
