"""Shared fixtures: one real nats-server (JetStream, temporary store, random port) per test session.

Also, under ``TRITON_INTERPRET=1``, the interpreter patches ``triton.language`` once per kernel
launch instead of once per ``@triton.jit`` call (``_patch_lang_once``)."""

from __future__ import annotations

import os

import pytest

from llmbus.bus.server import EmbeddedNats


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory) -> str:
    """URL of a nats-server started for this test session and stopped after it."""
    with EmbeddedNats(tmp_path_factory.mktemp("nats")) as server:
        yield server.url


def _patch_lang_once() -> None:
    """Triton's interpreter swaps ``triton.language``'s builtins for interpreted ones when a kernel
    launches (undone when it returns), and again at every call of a ``@triton.jit`` function from
    inside it, scanning the modules' members each time. The second time changes nothing (a swapped
    builtin is skipped) but took half of a test's time in our kernels, which are built from small
    functions (cProfile of test_kernels_prefill: 23 s of 47). Here a call from inside a launch that
    would swap only modules the launch already swapped does nothing; the rest run as before."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original, scope_type = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None:  # another Triton: leave it as it is
        return
    swapped: set[int] = set()  # the language modules swapped by the launch running now

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if swapped and langs <= swapped:
            return scope_type()
        scope = original(fn)
        if not swapped:  # a launch: its scope is the one restored when it returns
            restore = scope.restore

            def restore_all() -> None:
                swapped.clear()
                restore()

            scope.restore = restore_all
        swapped.update(langs)
        return scope

    patch_lang.__wrapped__ = original
    interpreter._patch_lang = patch_lang


_patch_lang_once()
