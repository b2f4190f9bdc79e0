"""The CPU tier of cached prefix blocks: one POSIX shared-memory segment cut into fixed slots.

Slot size is one block in the CPU tier's format (so an INT8 CPU tier holds about twice the blocks
of a bf16 one in the same budget). Block hash -> slot; the lowest free slot is used first. Only
kvpool writes here; the segment lives in shared memory so same-host readers could map it, and it
is unlinked when kvpool closes the tier (the CPU tier does not survive a restart; SSD does).
"""

from __future__ import annotations

from llmbus.bus import shm


class CpuTier:
    def __init__(self, capacity_bytes: int, slot_bytes: int, name: str | None = None) -> None:
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be >= 1, got {slot_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"CPU tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.slot_bytes = slot_bytes
        self.slots = capacity_bytes // slot_bytes
        self.capacity_bytes = self.slots * slot_bytes
        self.name = name or shm.new_segment_name("llmbus_kvcpu")
        self._shm = shm.create(self.name, self.capacity_bytes) if self.slots else None
        self._free = list(range(self.slots - 1, -1, -1))  # a stack: pop() gives the lowest slot
        self._slot_of: dict[bytes, int] = {}

    def __contains__(self, h: bytes) -> bool:
        return h in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def full(self) -> bool:
        return not self._free

    @property
    def used_bytes(self) -> int:
        return len(self._slot_of) * self.slot_bytes

    def put(self, h: bytes, data: bytes | memoryview) -> int:
        """Store a block in a free slot (the caller evicts first when ``full``); returns the slot."""
        view = memoryview(data).cast("B")
        if len(view) != self.slot_bytes:
            raise ValueError(f"a CPU-tier block is {self.slot_bytes} bytes, got {len(view)}")
        slot = self._slot_of.get(h)
        if slot is None:
            if not self._free:
                raise ValueError("the CPU tier is full; evict a block first")
            slot = self._free.pop()
            self._slot_of[h] = slot
        start = slot * self.slot_bytes
        self._shm.buf[start : start + self.slot_bytes] = view
        return slot

    def get(self, h: bytes) -> bytes | None:
        slot = self._slot_of.get(h)
        if slot is None:
            return None
        start = slot * self.slot_bytes
        return bytes(self._shm.buf[start : start + self.slot_bytes])

    def delete(self, h: bytes) -> bool:
        slot = self._slot_of.pop(h, None)
        if slot is None:
            return False
        self._free.append(slot)
        self._free.sort(reverse=True)
        return True

    def close(self) -> None:
        shm.destroy(self._shm)
        self._shm = None
