"""Attention metadata for one batched step, and the backends that consume it.

A step's tokens are flattened: the first ``num_decodes`` sequences are decodes (one query token
each), the rest are prefill chunks. The model hands each layer's q/k/v and that layer's opaque
cache object to the backend; only the backend knows what a cache object holds (a model-dtype
tensor here, data plus scales for quantized formats).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from llmbus.kernels import reference
from llmbus.kv.layout import KVLayout


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every new token
    block_tables: torch.Tensor  # [B, M] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32: context length after this step's write
    query_start_loc: torch.Tensor  # [B+1] int32: cumulative query lengths
    num_decodes: int  # sequences [0, num_decodes) have exactly one query token
    # [T] int64: each new token's slot in its sequence's exact tail row (row * block_size +
    # offset in block, -1 without a row); None when the KV format keeps no tails (llmbus.kv.formats)
    tail_slots: torch.Tensor | None = None
    # [B] int32: the tail row holding each sequence's last block after this step's write (-1: none);
    # attention reads a partial last block's keys and values from it. None with tail_slots.
    tail_rows: torch.Tensor | None = None
    # host-side bounds (None: kernels read them from the tensors above, a device-to-host sync on
    # CUDA): the longest decode context, the longest query of any sequence
    max_decode_len: int | None = None
    max_query_len: int | None = None
    # NOTE: per-step data a backend derives from the fields above at the first layer and reuses in
    # every other layer (keyed by backend name; "prefill_qsl": prefill_query_start_loc's). The
    # fields above must not change within a step.
    backend_plans: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    def prefill_query_start_loc(self) -> torch.Tensor:
        """``query_start_loc`` of the prefill sequences alone (starting at 0), made once a step."""
        qsl = self.backend_plans.get("prefill_qsl")
        if qsl is None:
            nd = self.num_decodes
            qsl = self.backend_plans["prefill_qsl"] = (self.query_start_loc[nd:] - self.query_start_loc[nd]).to(torch.int32)
        return qsl


def seals_and_starts(start: int, end: int, block_size: int) -> bool:
    """Whether computing tokens ``[start, end)`` seals a block that earlier steps began (so its
    sealing reads that block's tail row) and also leaves a new block filling (whose tokens write
    a tail row): the step then needs two rows (see ``TailRows``)."""
    return bool(start % block_size) and end // block_size > start // block_size and bool(end % block_size)


def build_attention_metadata(
    entries: Sequence[tuple[Sequence[int], int, int]],
    block_size: int,
    device: torch.device | str = "cpu",
    tail_rows: Sequence[tuple[int, int]] | None = None,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """``entries``: per sequence ``(block_table, num_computed, num_new)``, decodes (``num_new == 1``)
    first; ``tail_rows``: per sequence the exact tail rows (-1: none) of the block its first new
    token falls in and of its later blocks (None: no tails; see ``TailRows`` for why two).
    Returns the metadata and the ``[T]`` int64 positions of the step's tokens.

    A block table must cover ``num_computed + num_new`` tokens."""
    if not entries:
        raise ValueError("a step needs at least one sequence")
    if tail_rows is not None and len(tail_rows) != len(entries):
        raise ValueError(f"tail_rows has {len(tail_rows)} entries for {len(entries)} sequences")
    # NOTE: built as flat lists and moved in two transfers (the int64 fields, then the int32
    # ones) through array buffers: ~3x faster than torch.tensor on nested lists, and one copy a
    # dtype to a GPU instead of one a field. Decodes take the one-token path.
    slots: list[int] = []
    positions: list[int] = []
    tails: list[int] = []
    last_rows: list[int] = []
    seq_lens: list[int] = []
    qsl = [0]
    num_decodes = 0
    seen_prefill = False
    width = 0
    for i, (table, start, n) in enumerate(entries):
        if n < 1 or start < 0:
            raise ValueError(f"sequence {i}: num_new must be >= 1 and num_computed >= 0, got {n} and {start}")
        end = start + n
        if len(table) * block_size < end:
            raise ValueError(f"sequence {i}: block table of {len(table)} blocks cannot hold {end} tokens")
        width = max(width, len(table))
        if n == 1:
            num_decodes += not seen_prefill
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            seen_prefill = True
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        if tail_rows is not None:
            rows = (tail_rows[i][0], tail_rows[i][1])
            first = start // block_size
            if rows[0] == rows[1] >= 0 and seals_and_starts(start, end, block_size):
                # NOTE: the sealing program reads row 0 while this step's new block writes row 1:
                # one row for both would race in the Triton write kernel (see TailRows)
                raise ValueError(f"sequence {i}: tokens [{start}, {end}) seal a block from tail row {rows[0]} "
                                 "and start another: they need two different rows")
            for p in range(start, end):
                row = rows[p // block_size != first]
                tails.append(row * block_size + p % block_size if row >= 0 else -1)
            last_rows.append(row)
        seq_lens.append(end)
        qsl.append(qsl[-1] + n)
    b = len(entries)
    tables: list[int] = []
    for table, _, _ in entries:
        tables += table
        if len(table) < width:
            tables += [0] * (width - len(table))
    slot_mapping, positions_t, tail_slots = _packed("q", torch.int64, device, slots, positions, tails)
    block_tables, seq_lens_t, qsl_t, last_rows_t = _packed("i", torch.int32, device, tables, seq_lens, qsl, last_rows)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables.view(b, width),
        seq_lens=seq_lens_t,
        query_start_loc=qsl_t,
        num_decodes=num_decodes,
        max_decode_len=max(seq_lens[:num_decodes], default=0),
        max_query_len=max(hi - lo for lo, hi in zip(qsl, qsl[1:])),
        tail_slots=tail_slots if tail_rows is not None else None,
        tail_rows=last_rows_t if tail_rows is not None else None,
    )
    return meta, positions_t


def _packed(code: str, dtype: torch.dtype, device: torch.device | str, *parts: list[int]) -> list[torch.Tensor]:
    """``parts`` as 1-D tensors on ``device``: views of one buffer (on CPU, an array's memory),
    moved in one copy. NOTE: each part starts a multiple of 16 bytes into the buffer, as aligned
    as a tensor of its own: Triton compiles a kernel variant per pointer alignment it sees."""
    per = 16 // array(code).itemsize
    flat: list[int] = []
    offsets = []
    for part in parts:
        offsets.append(len(flat))
        flat += part
        flat += _ZEROS[: -len(flat) % per]
    whole = torch.frombuffer(array(code, flat), dtype=dtype) if flat else torch.empty(0, dtype=dtype)
    if torch.device(device).type != "cpu":
        whole = whole.to(device)
    return [whole[o : o + len(part)] for o, part in zip(offsets, parts)]


_ZEROS = [0] * 16


class AttentionBackend(Protocol):
    name: str

    def allocate_cache(self, layout: KVLayout, num_blocks: int, device: torch.device,
                       tail_rows: int = 0) -> list[object]: ...

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        cache: object,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [T, Hq, D]


_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


class TorchAttentionBackend:
    """Pure-torch paged attention (the kernels' reference), used on CPU."""

    name = "torch"

    def allocate_cache(self, layout: KVLayout, num_blocks: int, device: torch.device,
                       tail_rows: int = 0) -> list[torch.Tensor]:
        """``tail_rows``: exact tail rows, which the model dtype does not need (ignored)."""
        dtype = torch_dtype(layout.dtype)
        return [torch.zeros(layout.cache_shape(num_blocks), dtype=dtype, device=device) for _ in range(layout.num_layers)]

    @staticmethod
    def read_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """uint8 ``[n, layer_block_bytes]``: block ``i``'s keys then values."""
        sel = cache.index_select(1, block_ids).movedim(1, 0).contiguous()
        return sel.reshape(block_ids.numel(), -1).view(torch.uint8)

    @staticmethod
    def write_blocks(cache: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        n = block_ids.numel()
        shape = (n, 2, *cache.shape[2:])
        rows = data.to(cache.device).contiguous().view(cache.dtype).reshape(shape).movedim(0, 1)
        cache.index_copy_(1, block_ids, rows)

    def forward(self, q, k, v, cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        reference.write_kv(k, v, cache, meta.slot_mapping)
        nd = meta.num_decodes
        out = torch.empty_like(q)
        if nd:
            out[:nd] = reference.paged_decode_attention(
                q[:nd], cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale
            )
        if nd < meta.seq_lens.shape[0]:
            qsl = meta.query_start_loc[nd:] - meta.query_start_loc[nd]
            out[nd:] = reference.paged_prefill_attention(
                q[nd:], cache, meta.block_tables[nd:], meta.seq_lens[nd:], qsl, scale
            )
        return out
