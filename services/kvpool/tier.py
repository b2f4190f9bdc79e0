"""The CPU tier: one POSIX shared-memory segment of ``capacity`` blocks, owned by kvpool.

Block handle ``b`` is bytes ``[b * block_bytes, (b + 1) * block_bytes)`` of the segment. Workers on
this host attach the segment by the name in their Lease and copy to and from it directly; workers
elsewhere go through kvpool's read/write ops, which land here.
"""

from __future__ import annotations

from llmbus.bus import shm


class CpuTier:
    def __init__(self, block_bytes: int, capacity: int, name: str | None = None) -> None:
        self.block_bytes = block_bytes
        self.capacity = capacity
        self.name = name or shm.new_segment_name()
        self._shm = shm.create(self.name, block_bytes * capacity)

    def write(self, blocks: list[int], offset: int, data: bytes | memoryview) -> int:
        buf = self._shm.buf
        src = memoryview(data).cast("B")
        pos = 0
        for start, n in shm.lease_spans(blocks, self.block_bytes, offset, len(src)):
            buf[start : start + n] = src[pos : pos + n]
            pos += n
        return pos

    def read(self, blocks: list[int], offset: int, length: int) -> bytes:
        buf = self._shm.buf
        return b"".join(bytes(buf[s : s + n]) for s, n in shm.lease_spans(blocks, self.block_bytes, offset, length))

    def gather(self, blocks: list[int]):
        """uint8 ``[len(blocks), block_bytes]``: the blocks copied out in one pass (a torch tensor;
        the segment's view is released before returning, so ``close`` never finds it exported)."""
        import torch

        whole = torch.frombuffer(self._shm.buf, dtype=torch.uint8).view(self.capacity, self.block_bytes)
        try:
            return whole[torch.tensor(blocks, dtype=torch.int64)]
        finally:
            del whole

    def close(self) -> None:
        """Unmap and unlink the segment (kvpool is its only owner)."""
        shm.destroy(self._shm)
        self._shm = None
