"""The event loop every llmbus process runs on: the services, the gateway and the benchmark client."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory():
    """uvloop's event loop where it is installed (less CPU per message and per HTTP chunk, CPU the
    engines share on a small machine), unless ``LLMBUS_UVLOOP=0``; else asyncio's own."""
    if os.environ.get("LLMBUS_UVLOOP", "1") == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop ``loop_factory`` picks."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
