"""Decode steps replayed as CUDA graphs (``--cuda-graphs``).

A decode step at small batch is bound by launching, not by the GPU: the large demo model's step
took ~10 ms on an H200 at batch 1 (docs/benchmarks.md), a dozen kernels and their Python around
each of 12 layers, for a few hundred microseconds of GPU work. ``DecodeGraphs`` records the
model's forward for decode-only batches of a few sizes once, over static input buffers, and a
step then fills the buffers and replays the size at or above its batch: one launch.

What makes a forward recordable: it reads nothing back to the host (``tests/test_host_syncs.py``)
and its launches do not depend on the step's values. The bounds the attention kernels take from
the metadata are fixed per recording: the longest context is ``max_model_len`` (so decode sizes
its split-K grid for that length; each sequence splits its own length over it, in whole tiles,
and the splits past that find no work). Rows past the batch are padding:
their tokens write their keys and values into a block of their own (the cache's last, which the
block manager never hands out) and attend to nothing (context length 0).

Without CUDA (``record=False``) the same buffers and padding run eagerly: the tests compare that
path with the dynamic one on the Triton kernels under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from llmbus.engine.attention import AttentionMetadata

log = logging.getLogger(__name__)


def batch_sizes(max_batch: int) -> list[int]:
    """The recorded batch sizes: 1, 2, 4, 8, then every multiple of 8, up to ``max_batch``."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    """Static buffers and one recorded forward per batch size; ``sink_block``: the cache block
    padding rows write to (no sequence may own it)."""

    def __init__(self, model, caches: list[object], block_size: int, max_batch: int, max_model_len: int,
                 sink_block: int, device: torch.device, tails: bool, record: bool) -> None:
        self.model = model
        self.caches = caches
        self.block_size = block_size
        self.sizes = batch_sizes(max_batch)
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // block_size)
        self.record = record
        n = self.sizes[-1]
        self._sink_slot = sink_block * block_size
        self.device = device
        # NOTE: the per-row fields live in two buffers (int64: ids, positions, slots, tail slots;
        # int32: lengths, tail rows), each filled on the host and copied in one transfer a step
        pinned = device.type == "cuda"
        self._host64 = torch.zeros(4, n, dtype=torch.int64, pin_memory=pinned)
        self._host32 = torch.zeros(2, n, dtype=torch.int32, pin_memory=pinned)
        self._dev64 = torch.zeros(4, n, dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(2, n, dtype=torch.int32, device=device)
        self.ids, self.positions, self.slots, tail_slots = self._dev64.unbind(0)
        self.lens, tail_rows = self._dev32.unbind(0)
        self.tail_slots = tail_slots if tails else None
        self.tail_rows = tail_rows if tails else None
        self.tables = torch.zeros(n, self.width, dtype=torch.int32, device=device)
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._copied = torch.cuda.Event() if pinned else None  # the last transfer out of the host buffers
        self._fill(0, 0, n)
        self._dev64.copy_(self._host64)
        self._dev32.copy_(self._host32)

    def size_for(self, batch: int) -> int | None:
        """The recorded size a decode batch of ``batch`` runs at; None if it is too large."""
        return next((s for s in self.sizes if s >= batch), None)

    def fits(self, num_decodes: int, table_width: int) -> bool:
        return self.size_for(num_decodes) is not None and table_width <= self.width

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:size], block_tables=self.tables[:size], seq_lens=self.lens[:size],
            query_start_loc=self.qsl[: size + 1], num_decodes=size, max_decode_len=self.max_model_len,
            max_query_len=1,
            tail_slots=None if self.tail_slots is None else self.tail_slots[:size],
            tail_rows=None if self.tail_rows is None else self.tail_rows[:size],
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.ids[:size], self.positions[:size], self.caches, self._meta(size))

    def capture(self) -> bool:
        """Record every size (largest first, all in one memory pool), each after one eager run
        that compiles its kernels. The buffers hold padding only: nothing real is written.

        False if recording failed (out of memory, an op that may not be recorded): the error is
        logged, nothing stays recorded, and the caller runs its steps without these buffers."""
        if not self.record:
            return True
        cuda = self.device.type == "cuda"
        stream = torch.cuda.current_stream(self.device) if cuda else None
        try:
            # as the steps run (ModelRunner.execute), on the cache's device
            with torch.inference_mode(), torch.cuda.device(self.device):
                self._capture()
        except Exception:  # noqa: BLE001 - any failure to record leaves decode working, only slower
            log.exception("recording decode steps as CUDA graphs failed: every step runs on the dynamic path")
            self._graphs.clear()
            if cuda:
                # NOTE: an invalidated capture raises again in capture_end, before torch puts the
                # previous stream back; and a fault that poisons the context must stop the start
                # here, not at the first request
                torch.cuda.set_stream(stream)
                torch.cuda.synchronize(self.device)
            return False
        return True

    def _capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def _fill(self, b: int, start: int, end: int, meta: AttentionMetadata | None = None,
              ids: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> None:
        """Host buffers: rows ``[0, b)`` from a step, ``[start, end)`` padding (slot in the sink
        block, no tail, length 0)."""
        h64, h32 = self._host64, self._host32
        if b:
            h64[0, :b] = ids
            h64[1, :b] = positions
            h64[2, :b] = meta.slot_mapping
            h32[0, :b] = meta.seq_lens
            if meta.tail_slots is not None:
                h64[3, :b] = meta.tail_slots
                h32[1, :b] = meta.tail_rows
        h64[2, start:end] = self._sink_slot
        h64[3, start:end] = -1
        h32[0, start:end] = 0
        h32[1, start:end] = -1

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One decode-only step: ``ids``, ``positions`` and ``meta`` as the dynamic path builds
        them, on the host; returns the final hidden states of its ``B`` rows (a view of the
        recording's output, valid until the next ``run``)."""
        b, w = meta.seq_lens.shape[0], meta.block_tables.shape[1]
        if meta.num_decodes != b or not self.fits(b, w):
            raise ValueError(f"a recorded decode step takes up to {self.sizes[-1]} decodes of up to "
                             f"{self.width} blocks, got {meta.num_decodes} of {b} rows, {w} blocks")
        if (meta.tail_slots is None) != (self.tail_slots is None):
            raise ValueError("the step's tail rows do not match the recording's")
        size = self.size_for(b)
        with torch.cuda.device(self.device) if self.record else contextlib.nullcontext():
            return self._run(b, w, size, ids, positions, meta)

    def _run(self, b: int, w: int, size: int, ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # NOTE: the pinned buffers' last transfer is done before refilling
        self._fill(b, b, size, meta, ids, positions)
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32.copy_(self._host32, non_blocking=True)
        self.tables[:b, :w].copy_(meta.block_tables, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        recorded = self._graphs.get(size)
        if recorded is None:
            return self._forward(size)[:b]
        graph, out = recorded
        graph.replay()
        return out[:b]
