"""Compile every Triton kernel for an NVIDIA GPU without one (default target sm_90, the H200).

Each launch wrapper (``write_kv``, ``paged_decode_attention``, ``paged_prefill_attention``, the
split-K reduction and ``llmbus.kernels.fused``'s) runs as it would on CUDA: its tensors report ``is_cuda`` (so the wrapper picks
the CUDA launch configuration, tile sizes and dot dtypes), and a stand-in driver compiles each
launch to a cubin (ptxas included) instead of running it. That catches what fails to compile
natively, which the interpreter (``TRITON_INTERPRET=1``, where the kernel tests run) accepts; it
says nothing of results, which only a GPU shows (``scripts/gpu_check.sh``). The Triton here may be
newer than a lent GPU machine's.

    python scripts/compile_kernels.py [--arch 90] [--jobs N]

Prints one line per kernel variant and exits 1 if any failed to compile. ``--jobs`` processes
(default: the CPU count, up to 4) compile a share of the variants each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # NOTE: before triton.jit decorates our kernels
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class CudaLike(torch.Tensor):
    """A CPU tensor the wrappers take for a CUDA one (their launch choices read ``is_cuda``)."""

    @property
    def is_cuda(self) -> bool:
        return True


class CompileOnlyDriver:
    """The active-driver surface a compile-only launch touches."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_device_interface(self):
        return torch.cuda

    def get_active_torch_device(self):
        return torch.device("cpu")


def compile_only(arch: int) -> list[tuple[str, object]]:
    """From now on every ``kernel[grid](...)`` compiles for ``sm_<arch>`` (``warmup``) instead of
    launching. Returns the list each compiled kernel is appended to, as ``(name, CompiledKernel)``."""
    driver.set_active(CompileOnlyDriver(arch))
    compiled: list[tuple[str, object]] = []
    launch = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        if "cubin" not in kernel.asm:
            raise RuntimeError(f"{self.fn.__name__}: no cubin")
        compiled.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = run
    return compiled


def cuda_cache(fmt: str, layout, tail_rows: int = 0, head_major: bool = False):
    """An 8-block ``PagedKVCache`` whose tensors the launch wrappers take for CUDA ones."""
    from llmbus.kernels.kv_cache import allocate_cache
    from llmbus.kv.formats import KVFormat

    cache = allocate_cache(KVFormat(fmt), layout, 8, "cpu", tail_rows=tail_rows, head_major=head_major)
    for field in ("data", "scale", "k_meta", "v_meta", "k_tail", "v_tail"):
        if getattr(cache, field) is not None:
            setattr(cache, field, getattr(cache, field).as_subclass(CudaLike))
    return cache


def variants():
    """(name, thunk) per kernel configuration: every KV format at head_dim 128 (the real models'),
    INT4 and INT4R also at 64 (their lane loops' narrowest: class dots of 16 channels) and 16 (the
    generic-tile path), with and without tail rows; every format over head-major caches (the engine's
    on CUDA);
    split-K on and off; INT8's, INT4R's and INT4's shared loops (their per-warp or per-block loops
    are the default) and those loops at other GQA groups."""
    from llmbus.kernels.paged_decode import paged_decode_attention
    from llmbus.kernels.paged_prefill import paged_prefill_attention
    from llmbus.kernels.write_kv import write_kv
    from llmbus.kv.layout import KVLayout

    def cuda(t):
        return t.as_subclass(CudaLike)

    # (format, head_dim, tail rows, head-major)
    cases = [("model", 128, False, False), ("int8", 128, False, False), ("int4", 128, False, False),
             ("int4", 128, True, False), ("int4", 64, False, False), ("int4", 16, False, False),
             ("int4", 16, True, False),
             # int4r: its token loop at 128 (tail rows) and 64 (class dots of 16), the generic tile at 16
             ("int4r", 128, True, False), ("int4r", 64, False, False), ("int4r", 16, True, False)]
    # head-major caches (kv_cache.allocate_cache; the engine's on CUDA, with tail rows for INT4 and
    # INT4R): other strides, so other specializations
    cases += [("model", 128, False, True), ("int8", 128, False, True), ("int4", 128, False, True),
              ("int4", 128, True, True), ("int4r", 128, True, True)]
    for fmt, d, tails, head_major in cases:
        lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=d, block_size=16, dtype="bfloat16")
        cache = cuda_cache(fmt, lay, tail_rows=4 if tails else 0, head_major=head_major)
        kv = cuda(torch.randn(5, 2, d).to(torch.bfloat16))
        slots = cuda(torch.arange(5))
        tail_slots = cuda(torch.arange(5)) if tails else None
        q = cuda(torch.randn(2, 8, d).to(torch.bfloat16))
        tables = cuda(torch.zeros(2, 4, dtype=torch.int32))
        lens = cuda(torch.tensor([40, 5], dtype=torch.int32))
        rows = cuda(torch.tensor([0, -1], dtype=torch.int32)) if tails else None
        qsl = cuda(torch.tensor([0, 1, 2], dtype=torch.int32))
        tag = f"{fmt} D={d}{' tails' if tails else ''}{' head-major' if head_major else ''}"
        yield f"write {tag}", lambda: write_kv(kv, kv, cache, slots, tail_slots)
        for splits in (1, 2):
            yield (f"decode {tag} splits={splits}",
                   lambda s=splits: paged_decode_attention(q, cache, tables, lens, 0.1, num_splits=s, tail_rows=rows))
        # NOTE: with the chunk's own keys and values, as the engine's backend passes them
        yield f"prefill {tag}", lambda: paged_prefill_attention(q, cache, tables, lens, qsl, 0.1, tail_rows=rows,
                                                                chunk=(kv[:2], kv[:2]))
        if d == 128 and not head_major and (fmt == "int8" or (fmt == "int4r" and tails) or (fmt == "int4" and not tails)):
            # the loops with the warps sharing a softmax (paged_decode.WARP_TILES off: their own launch)
            yield (f"decode {tag} shared tiles", lambda: paged_decode_attention(
                q, cache, tables, lens, 0.1, num_splits=2, tail_rows=rows, warp_tiles=False))
            # the per-warp loops' query rows are the dots' columns, padded to a power of two (GP):
            # groups of 1, 2 and 8 beside the 4 above (INT4R's tail rows then attend at GP rows too)
            for g in (1, 2, 8):
                qg = cuda(torch.randn(2, 2 * g, d).to(torch.bfloat16))
                yield (f"decode {tag} group={g}", lambda qg=qg: paged_decode_attention(
                    qg, cache, tables, lens, 0.1, num_splits=2, tail_rows=rows))
    yield from fused_variants(cuda)


def fused_variants(cuda):
    """llmbus.kernels.fused at Llama-3-8B's sizes (hidden 4096, 32 + 8 heads of 128, intermediate 14336)
    in bf16, and the norm in float32."""
    from llmbus.kernels import fused

    for dtype in (torch.bfloat16, torch.float32):
        x, w = cuda(torch.randn(3, 4096).to(dtype)), cuda(torch.ones(4096).to(dtype))
        yield f"rms_norm {dtype}", lambda x=x, w=w: fused.rms_norm(x, w, 1e-5)
        yield f"rms_norm + residual {dtype}", lambda x=x, w=w: fused.rms_norm(x, w, 1e-5, x.clone())
    qkv = cuda(torch.randn(3, 48 * 128).to(torch.bfloat16))
    cos = cuda(torch.randn(3, 1, 64).to(torch.bfloat16))
    yield "rotary bf16", lambda: fused.rotary_(qkv[:, : 40 * 128].view(3, 40, 128), cos, cos)
    gate_up = cuda(torch.randn(3, 2 * 14336).to(torch.bfloat16))
    yield "silu_mul bf16", lambda: fused.silu_mul(gate_up)


def compile_variants(arch: int, shard: tuple[int, int] = (0, 1)):
    """``(index, ok, report)`` for each variant whose index is ``k`` modulo ``n`` (``shard``)."""
    compiled = compile_only(arch)
    k, shards = shard
    for i, (name, thunk) in enumerate(variants()):
        if i % shards != k:
            continue
        compiled.clear()
        try:
            thunk()
            yield i, True, f"ok      {name}: {', '.join(n for n, _ in compiled)}"
        except Exception:  # NOTE: report every variant, then fail
            yield i, False, f"FAILED  {name}\n{traceback.format_exc(limit=4)}"


def run_shards(arch: int, jobs: int) -> list[tuple[int, bool, str]]:
    """``compile_variants`` split over ``jobs`` processes (compiling is CPU-bound, one core a
    process): their reports, in variant order. A shard that dies is a failed report."""
    procs = [subprocess.Popen([sys.executable, __file__, "--arch", str(arch), "--shard", f"{k}/{jobs}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(jobs)]
    reports = []
    for k, proc in enumerate(procs):
        out, err = proc.communicate()
        reports += [tuple(json.loads(line)) for line in out.splitlines() if line.startswith("[")]
        if proc.returncode:
            reports.append((len(reports) + 10**6, False, f"FAILED  shard {k}/{jobs} exited {proc.returncode}\n{err[-2000:]}"))
    return sorted(reports)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 (H100/H200), 80 (A100)")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="processes compiling at once")
    ap.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # "k/n": one of run_shards' processes
    args = ap.parse_args(argv)
    if args.shard:
        k, n = (int(x) for x in args.shard.split("/"))
        for report in compile_variants(args.arch, (k, n)):
            print(json.dumps(report), flush=True)
        return 0
    if args.jobs > 1:
        reports = run_shards(args.arch, args.jobs)
    else:
        reports = compile_variants(args.arch)
    failed = 0
    for _, ok, text in reports:
        failed += not ok
        print(text, flush=True)
    print(f"{failed} of the variants failed to compile for sm_{args.arch}" if failed else f"all compiled for sm_{args.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
