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

import torch

from llmbus.engine.attention import AttentionMetadata


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
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), self._sink_slot, dtype=torch.int64, device=device)
        self.tables = torch.zeros(n, self.width, dtype=torch.int32, device=device)
        self.lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.tail_slots = torch.full((n,), -1, dtype=torch.int64, device=device) if tails else None
        self.tail_rows = torch.full((n,), -1, dtype=torch.int32, device=device) if tails else None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

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

    def capture(self) -> None:
        """Record every size (largest first, all in one memory pool), each after one eager run
        that compiles its kernels. The buffers then hold padding only: nothing real is written."""
        if self.record:
            with torch.inference_mode():  # as the steps run (ModelRunner.execute)
                self._capture()

    def _capture(self) -> None:
        self._pad(0, self.sizes[-1])
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

    def _pad(self, start: int, end: int) -> None:
        if end > start:
            self.slots[start:end] = self._sink_slot
            self.lens[start:end] = 0
            if self.tail_slots is not None:
                self.tail_slots[start:end] = -1
                self.tail_rows[start:end] = -1

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One decode-only step: ``ids``, ``positions`` and ``meta`` as the dynamic path builds
        them (any device); returns the final hidden states of its ``B`` rows (a view of the
        recording's output, valid until the next ``run``)."""
        b, w = meta.seq_lens.shape[0], meta.block_tables.shape[1]
        if meta.num_decodes != b or not self.fits(b, w):
            raise ValueError(f"a recorded decode step takes up to {self.sizes[-1]} decodes of up to "
                             f"{self.width} blocks, got {meta.num_decodes} of {b} rows, {w} blocks")
        size = self.size_for(b)
        self.ids[:b].copy_(ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slots[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.tables[:b, :w].copy_(meta.block_tables, non_blocking=True)
        self.lens[:b].copy_(meta.seq_lens, non_blocking=True)
        if self.tail_slots is not None:
            self.tail_slots[:b].copy_(meta.tail_slots, non_blocking=True)
            self.tail_rows[:b].copy_(meta.tail_rows, non_blocking=True)
        self._pad(b, size)
        recorded = self._graphs.get(size)
        if recorded is None:
            return self._forward(size)[:b]
        graph, out = recorded
        graph.replay()
        return out[:b]
