"""Linear layers with weights pre-packed for oneDNN on CPU.

``F.linear`` on CPU hands each call's weight to the BLAS in its plain layout; oneDNN can instead
keep a weight reordered once into its blocked layout (what inductor's weight freezing does).
Measured on 2 AMD EPYC cores for the large demo model's projections: a decode-sized product
(32 rows) 4.27 -> 3.18 ms in bf16 and 16.0 -> 6.3 ms in fp32; prefill-sized (2,048 rows) 7-15%
faster. The results are the same products (oneDNN computes them either way in bf16; in fp32 the
summation order may differ in the last bits).

bf16 and float32 weights go further on CPUs with AVX-512 or AVX2 with FMA (bf16 with the bf16 dot
instruction where there is one, else widened): they are blocked once for our own kernel
(``llmbus.kernels.cpu_native.linear``, the layout and the reasons in llmbus/kernels/cpu_decode.c) instead of
oneDNN's, still one copy; where neither serves a weight (bf16 on a CPU without oneDNN's bf16 and
outputs not a multiple of 16), the model keeps its plain weights. A decode step at
low batch is bound by reading the weights once; oneDNN reads them at 11-15 GB/s on one core for
1-8 rows, the blocked kernel at 17-23 (the large demo model's projections,
scripts/bench_cpu_linear.py: bf16, one row, one thread 13.9 -> 7.8 ms; 32 rows 31.9 -> 30.6 ms;
1,024 rows, two threads, on par; float32, one thread: 1 row 22.96 -> 13.72 ms, the small demo
model's 0.34 -> 0.18 ms, 1,024 rows on par). ``LLMBUS_CPU_GEMM=onednn`` keeps oneDNN's layout
(for comparison).

On a CPU with AMX-BF16 (built with ``-march=native`` there, on Linux), blocked bf16 weights go
through AMX's tiles instead (``cpu_native.linear_amx``: the blocked layout is the tiles' weight
operand as it is, no copy), at every row count: on a 2-vCPU Xeon with AMX, the large demo model's
projections at 1 row as fast or faster (qkv 0.045 -> 0.028 ms), at 16 rows 3-6x, at 512 rows
8-10x (qkv 4.4 -> 0.39 ms, gate_up 13.9 -> 1.4, down 7.0 -> 0.86; oneDNN's AMX GEMM over the
weight unblocked for the call: 0.83, 2.5, 1.3). ``LLMBUS_CPU_AMX=0``: the AVX-512 kernel, for
comparison. Sums are fp32 either way, in another order.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmbus.kernels import cpu_native

# rows the packed layout is tuned for: the measured speed barely depends on it (1, 32 or 2,048)
BATCH_HINT = 32


@functools.cache
def amx_bf16() -> bool:
    """Whether blocked bf16 products run on AMX's tiles here (``LLMBUS_CPU_AMX=0``: never)."""
    return os.environ.get("LLMBUS_CPU_AMX", "1") != "0" and cpu_native.has_amx_bf16()


@dataclass(frozen=True)
class PackedWeight:
    """One copy of a weight, in exactly one of the two layouts."""

    onednn: torch.Tensor | None = None  # opaque oneDNN tensor
    blocked: torch.Tensor | None = None  # llmbus.kernels.cpu_native.to_blocked's layout


def _onednn_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True where oneDNN can run this dtype's packed linear on this device."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _blocked_wanted(weight: torch.Tensor) -> bool:
    return _blocked_allowed() and cpu_native.linear_supported(weight)


def _blocked_allowed() -> bool:
    return os.environ.get("LLMBUS_CPU_GEMM") != "onednn"


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True where a packed layout serves this dtype on this device: oneDNN's, or ours (bf16 on a
    CPU without oneDNN's bf16 but with AVX2, for one)."""
    if device.type != "cpu":
        return False
    return _onednn_supported(dtype, device) or _blocked_allowed() and cpu_native.has_linear(dtype)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` has a layout for this ``[out, in]`` weight."""
    return _blocked_wanted(weight) or _onednn_supported(weight.dtype, weight.device)


def pack(weight: torch.Tensor) -> PackedWeight:
    """``[out, in]`` -> a layout usable only by :func:`linear`: blocked for our kernel where it
    serves the weight, else oneDNN's (``can_pack`` says whether either does)."""
    if _blocked_wanted(weight):
        return PackedWeight(blocked=cpu_native.to_blocked(weight))
    if not _onednn_supported(weight.dtype, weight.device):
        raise ValueError(f"no packed layout for a {weight.dtype} {list(weight.shape)} weight on this CPU")
    return PackedWeight(onednn=torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.onednn is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    rows = x.reshape(-1, x.shape[-1])
    y = cpu_native.linear_amx(rows, packed.blocked, bias) if amx_bf16() else None
    if y is None and (y := cpu_native.linear(rows, packed.blocked, bias)) is None:  # rows the kernels do not take
        y = F.linear(rows, cpu_native.from_blocked(packed.blocked), bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])
