"""Real text on every machine with Python: the standard library's source, split once into files
to train on and files held out (``scripts/train_demo_model.py`` trains the demo architecture on
the first; the ``code`` benchmark dataset prompts with the second).

Held out: the files whose path under the standard library has a CRC-32 of 0 mod 20, so the split
is the same whatever other files a Python version adds or drops. Left out altogether: the test
suites and ``encodings/`` (generated codec tables that are near-copies of each other, which would
leak held-out text into training).
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

HELD_OUT_EVERY = 20  # a file is held out when crc32(its path under the stdlib) % 20 == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted, without its test suites and codec tables."""
    root = Path(root or stdlib_root())
    skip = {"test", "tests", "idle_test", "site-packages", "lib2to3", "encodings"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts[:-1]))


def is_held_out(path: Path, root: Path | None = None) -> bool:
    rel = path.relative_to(root or stdlib_root()).as_posix()
    return zlib.crc32(rel.encode()) % HELD_OUT_EVERY == 0
