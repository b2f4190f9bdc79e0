"""scripts/compile_kernels.py: every Triton kernel compiles natively for the H200's sm_90 without a
GPU, and the check fails where native compilation does though the interpreter runs the kernel."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmbus.kernels.paged_decode import CUDA_LAUNCH

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compile_kernels.py"
FP8_KERNEL = textwrap.dedent('''
    import torch
    import triton
    import triton.language as tl


    @triton.jit
    def to_fp8_and_back(x_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, tl.load(x_ptr + i).to(tl.float8e4nv).to(tl.float32))


    def run() -> torch.Tensor:
        x = torch.linspace(-2, 2, 16)
        out = torch.empty(16)
        to_fp8_and_back[(1,)](x, out, N=16)
        return out
''')


def _native_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def test_every_kernel_compiles_for_sm90():
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=_native_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "all compiled for sm_90"
    ok = [line for line in lines if line.startswith("ok ")]
    assert len(ok) == 78 and sum("reduce_splits_kernel" in line for line in ok) == 27
    assert any(line.startswith("ok      decode int4r D=128 tails splits=2") for line in ok)  # the per-warp loop
    for fmt in ("int8 D=128", "int4r D=128 tails", "int4 D=128"):  # the shared loops; the per-warp ones at 1, 2, 8 rows
        assert sum(line.startswith((f"ok      decode {fmt} shared tiles", f"ok      decode {fmt} group="))
                   for line in ok) == 4
    assert any(line.startswith("ok      decode int4 D=128 head-major splits=1") for line in ok)
    for fmt in ("model D=128", "int4 D=128 tails", "int4r D=128 tails"):  # the engine's caches on CUDA
        assert sum(line.startswith(f"ok      {kind} {fmt} head-major") for line in ok for kind in ("write", "decode",
                                                                                            "prefill")) == 4
    assert sum(line.startswith(("ok      rms_norm", "ok      rotary", "ok      silu_mul")) for line in ok) == 6
    assert any(line.startswith("ok      decode int4 D=128 tails splits=2") for line in ok)
    assert any(line.startswith("ok      decode int4 D=64 splits=2") for line in ok)  # the lane loop's narrowest


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="compares with the interpreter")
def test_compile_check_fails_where_native_compilation_does(tmp_path):
    """fp8 e4m3 needs sm_89 or newer: the interpreter runs the kernel, sm_80 refuses it."""
    (tmp_path / "fp8_kernel.py").write_text(FP8_KERNEL)
    spec = importlib.util.spec_from_file_location("fp8_kernel", tmp_path / "fp8_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.run().abs().max() > 1  # the interpreter emulates it
    check = textwrap.dedent(f'''
        import sys
        sys.path[:0] = [{str(SCRIPT.parent)!r}, {str(tmp_path)!r}]
        import compile_kernels
        compile_kernels.compile_only(int(sys.argv[1]))
        import fp8_kernel
        fp8_kernel.run()
        print("compiled")
    ''')
    for arch, compiles in ((80, False), (90, True)):
        proc = subprocess.run([sys.executable, "-c", check, str(arch)], env=_native_env(), capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert (proc.returncode == 0 and "compiled" in proc.stdout) == compiles, proc.stderr[-2000:]
        if not compiles:
            assert "fp8e4nv not supported" in proc.stderr


# a subprocess's start: every launch compiles for sm_90 (and lands in ``compiled``) instead of running
PRELUDE = textwrap.dedent('''
    import sys
    sys.path[:0] = [{scripts!r}, {root!r}]
    import compile_kernels as ck
    import torch
    compiled = ck.compile_only(90)
    from llmbus.kernels.paged_decode import paged_decode_attention
    from llmbus.kernels.paged_prefill import paged_prefill_attention
    from llmbus.kernels.write_kv import write_kv
    from llmbus.kv.layout import KVLayout

    def cuda(t):
        return t.as_subclass(ck.CudaLike)
''')
VARIANTS = PRELUDE + textwrap.dedent('''
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=128, block_size=16, dtype="bfloat16")
    cache = ck.cuda_cache("int8", lay)
    for t in (1, 16, 17):  # a step's token count
        kv = cuda(torch.randn(t, 2, 128).to(torch.bfloat16))
        write_kv(kv, kv, cache, cuda(torch.zeros(t, dtype=torch.int64)))
    q = cuda(torch.randn(2, 8, 128).to(torch.bfloat16))
    lens = cuda(torch.tensor([40, 5], dtype=torch.int32))
    qsl = cuda(torch.tensor([0, 1, 2], dtype=torch.int32))
    chunk = cuda(torch.randn(8, 2, 128).to(torch.bfloat16))  # the chunks' keys and values
    for width in (1, 16, 17):  # the block tables' width, which grows with the longest context
        tables = cuda(torch.zeros(2, width, dtype=torch.int32))
        paged_decode_attention(q, cache, tables, lens, 0.1, max_seq_len=40)
        paged_prefill_attention(q, cache, tables, lens, qsl, 0.1, chunk=(chunk[:2], chunk[:2]))
    for splits in (3, 4, 9):  # split counts that follow the context
        paged_decode_attention(q, cache, tables, lens, 0.1, num_splits=splits, max_seq_len=40)
    wide = cuda(torch.zeros(6, 3, dtype=torch.int32))
    six = cuda(torch.full((6,), 40, dtype=torch.int32))
    starts = cuda(torch.arange(7, dtype=torch.int32))
    for nd in (1, 2, 3):  # a mixed step's prompts: views past nd decodes' rows, at any alignment
        paged_prefill_attention(q[:2], cache, wide[nd : nd + 2], six[nd : nd + 2], starts[nd : nd + 3] - nd, 0.1,
                                chunk=(chunk[nd : nd + 2], chunk[nd : nd + 2]))
    from llmbus.kernels.paged_decode import decode_launch, single_split_kernel
    single = single_split_kernel(q, decode_launch(q, cache, tables, lens, max_seq_len=40), tables, lens)
    print("single-split variant:", single.metadata.num_warps, single.metadata.shared > 0)
    variants = {{}}
    for name, kernel in compiled:
        variants.setdefault(name, set()).add(kernel.hash)
    print(sorted((name, len(hashes)) for name, hashes in variants.items()))
''')


def test_per_step_sizes_compile_no_new_variants():
    """A step's token count, its block tables' width, the decode split count and (in a step
    mixing decodes with prompts) the offset of the prompts' rows change as a server runs; Triton
    would compile a variant per specialization of them (== 1, a multiple of 16, a pointer's
    alignment; the split count was a constexpr), stalling eager steps mid-stream. Each kernel
    compiles once across them (paged decode twice: without and with splits). The variant
    ``decode_launch`` compiles (not launches) to learn a launch's occupancy is the one the launch
    without splits runs."""
    code = VARIANTS.format(scripts=str(SCRIPT.parent), root=str(SCRIPT.parents[1]))
    proc = subprocess.run([sys.executable, "-c", code], env=_native_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"single-split variant: {CUDA_LAUNCH['int8'][1]} True" in proc.stdout  # the launch's warps
    assert proc.stdout.strip().splitlines()[-1] == str(
        [("paged_decode_kernel", 2), ("paged_prefill_kernel", 1), ("reduce_splits_kernel", 1), ("write_kv_kernel", 1)])


SHARED = PRELUDE + textwrap.dedent('''
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=256, block_size=256, dtype="bfloat16")
    cache = ck.cuda_cache("int8", lay)
    q = cuda(torch.randn(2, 8, 256).to(torch.bfloat16))
    tables = cuda(torch.zeros(2, 2, dtype=torch.int32))
    lens = cuda(torch.tensor([300, 5], dtype=torch.int32))
    paged_decode_attention(q, cache, tables, lens, 0.1, num_splits=1)
    paged_prefill_attention(q, cache, tables, lens, cuda(torch.tensor([0, 1, 2], dtype=torch.int32)), 0.1)
    print([(name, k.metadata.shared) for name, k in compiled])
''')


def test_wide_int8_tiles_fit_shared_memory():
    """Double-buffered, INT8 decode at head_dim 256 and 256-token blocks (tiles of 256 positions)
    would take 283 KB of shared memory a program and prefill 332 KB, over the H200's 227 KB:
    pipeline_stages gives such launches one buffer, as before (150 and 199 KB)."""
    code = SHARED.format(scripts=str(SCRIPT.parent), root=str(SCRIPT.parents[1]))
    proc = subprocess.run([sys.executable, "-c", code], env=_native_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sizes = dict(eval(proc.stdout.strip().splitlines()[-1]))  # noqa: S307 (our own subprocess's repr)
    assert set(sizes) == {"paged_decode_kernel", "paged_prefill_kernel"}
    assert all(0 < n <= 227 * 1024 for n in sizes.values()), sizes
