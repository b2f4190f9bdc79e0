"""The SSD tier: one checksummed file per block under a directory, with a byte budget.

File ``<dir>/<hash hex[:2]>/<hash hex>.kvb``: a fixed header, then the block's bytes.

    magic  b"LLKVBLK2"                       8
    format name, NUL padded                  8
    payload length (uint64 LE)               8
    token count (uint32 LE), flags (uint32)  8
    parent hash (16 bytes, zeros = root)    16
    blake2b-128 of the block's own hash, everything above and the payload   16

NOTE: a block is written to a temporary name, fsynced, renamed into place and its directory
fsynced BEFORE ``put`` returns, so anything the index learns about survives power loss. ``get``
re-checks the checksum on every read; a corrupt or truncated file is deleted and reported as a
miss, never served. The checksum covers the block's hash, which the file is named by: a valid file
under another block's name (restored or copied to the wrong place) fails it too. ``scan`` (start-up) rebuilds the list of valid blocks the same way.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"LLKVBLK2"  # 1: checksums without the block's hash (such files are dropped at scan)
_HEAD = struct.Struct("<8s8sQII16s")  # magic, format, length, token count, flags, parent
_SUM = 16
HEADER_BYTES = _HEAD.size + _SUM


@dataclass(frozen=True)
class SsdBlock:
    block_hash: bytes
    kv_format: str
    parent: bytes | None
    token_count: int
    size: int  # file bytes (what the budget counts)


def _checksum(block_hash: bytes, head: bytes, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(block_hash + head, digest_size=_SUM, person=b"llmbus-ssd")
    h.update(payload)
    return h.digest()


class SsdTier:
    def __init__(self, directory: str | Path, capacity_bytes: int, payload_bytes: int | None = None) -> None:
        """``payload_bytes``: every block's size, when known (a file of another size, written under
        another layout such as another dtype, is dropped as a corrupt one is)."""
        if capacity_bytes < 0:
            raise ValueError(f"SSD tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.payload_bytes = payload_bytes
        self.used_bytes = 0
        self._sizes: dict[bytes, int] = {}
        self.dropped_corrupt = 0

    def path(self, h: bytes) -> Path:
        x = h.hex()
        return self.dir / x[:2] / f"{x}.kvb"

    def __contains__(self, h: bytes) -> bool:
        return h in self._sizes

    def size_for(self, payload_bytes: int) -> int:
        return HEADER_BYTES + payload_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def put(self, h: bytes, data: bytes | memoryview, kv_format: str, *, parent: bytes | None = None,
            token_count: int = 0) -> int:  # fmt: skip
        """Write the block durably; returns the bytes it takes. The caller keeps within the budget."""
        if len(kv_format.encode()) > 8:
            raise ValueError(f"format name {kv_format!r} is longer than 8 bytes")
        payload = memoryview(data).cast("B")
        head = _HEAD.pack(MAGIC, kv_format.encode(), len(payload), token_count, 0, parent or bytes(16))
        final = self.path(h)
        final.parent.mkdir(parents=True, exist_ok=True)  # (the whole directory, if it was removed)
        tmp = final.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
                f.write(_checksum(h, head, payload))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError:  # a full disk, say: no half-written file stays behind
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(final.parent)
        size = self.size_for(len(payload))
        self.used_bytes += size - self._sizes.get(h, 0)
        self._sizes[h] = size
        return size

    def get(self, h: bytes) -> tuple[bytes, str] | None:
        """The block's payload and format, or None if absent, corrupt or truncated (then deleted)."""
        if h not in self._sizes:
            return None
        block = self._read(self.path(h), h)
        if block is None:
            self.delete(h)
            self.dropped_corrupt += 1
            return None
        return block[1], block[0].kv_format

    def delete(self, h: bytes) -> bool:
        size = self._sizes.pop(h, None)
        if size is None:
            return False
        self.used_bytes -= size
        try:
            self.path(h).unlink()
        except FileNotFoundError:
            pass
        return True

    def scan(self) -> list[SsdBlock]:
        """Re-index the directory at start-up: valid blocks, oldest file first; bad files deleted."""
        found: list[tuple[float, SsdBlock]] = []
        for path in self.dir.glob("*/*"):
            if path.suffix == ".tmp":  # a write that never finished
                path.unlink(missing_ok=True)
                continue
            try:
                h = bytes.fromhex(path.stem)
            except ValueError:
                continue
            block = self._read(path, h)
            if block is None or len(h) != 16:
                path.unlink(missing_ok=True)
                self.dropped_corrupt += 1
                continue
            found.append((path.stat().st_mtime, block[0]))
        found.sort(key=lambda x: x[0])
        self._sizes = {b.block_hash: b.size for _, b in found}
        self.used_bytes = sum(self._sizes.values())
        return [b for _, b in found]

    def _read(self, path: Path, h: bytes) -> tuple[SsdBlock, bytes] | None:
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        if len(raw) < HEADER_BYTES:
            return None
        head = raw[: _HEAD.size]
        magic, fmt, length, tokens, _flags, parent = _HEAD.unpack(head)
        if magic != MAGIC or len(raw) != HEADER_BYTES + length:
            return None
        if self.payload_bytes is not None and length != self.payload_bytes:  # another layout's block
            return None
        payload = raw[_HEAD.size : _HEAD.size + length]
        if _checksum(h, head, payload) != raw[-_SUM:]:
            return None
        meta = SsdBlock(h, fmt.rstrip(b"\0").decode(), None if parent == bytes(16) else parent, tokens, len(raw))
        return meta, payload


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
