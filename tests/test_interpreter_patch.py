"""tests/conftest.py's ``_patch_lang_once``: under ``TRITON_INTERPRET=1`` a kernel launch swaps
``triton.language`` for the interpreter once, not again at each call of a jit function inside it,
and gives the same results."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's patching")


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _nested_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    for _ in range(5):
        x = _twice(x)
    tl.store(out_ptr + i, tl.sum(x, axis=0) + x)  # tl.sum: a jit function of triton.language.standard


def _count_swaps(monkeypatch) -> list[str]:
    from triton.runtime import interpreter

    swaps = []
    real = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda pkg, *a: (swaps.append(pkg.__name__), real(pkg, *a))[1])
    return swaps


def _launch(monkeypatch, patch_lang) -> tuple[torch.Tensor, int]:
    """The kernel's output and how many times a launch swapped a module's builtins."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter, "_patch_lang", patch_lang)
    swaps = _count_swaps(monkeypatch)
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty_like(x)
    _nested_kernel[(1,)](x, out, 8)
    monkeypatch.undo()
    return out, len(swaps)


def test_a_launch_swaps_the_language_once_however_many_jit_calls_it_makes(monkeypatch):
    from triton.runtime import interpreter

    once = interpreter._patch_lang
    assert once.__wrapped__ is not None  # installed by tests/conftest.py
    want = torch.arange(8, dtype=torch.float32) * 32
    for _ in range(2):  # the second launch swaps all again: the first one's swaps were undone
        out, swaps = _launch(monkeypatch, once)
        torch.testing.assert_close(out, want + want.sum())
        # Triton's own: the five calls of _twice swap everything again, each
        out_each, swaps_each = _launch(monkeypatch, once.__wrapped__)
        assert torch.equal(out_each, out)
        assert 0 < swaps <= swaps_each - 5 * 3, (swaps, swaps_each)
    assert tl.core.is_builtin(tl.arange) and tl.core.is_builtin(tl.tensor.__add__)  # undone after the launch
