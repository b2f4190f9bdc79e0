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
    assert len(ok) == 34 and sum("reduce_splits_kernel" in line for line in ok) == 7
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
