"""Building one step's ``AttentionMetadata`` from plain per-sequence state."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmbus.engine.attention import AttentionMetadata


def build_attention_metadata(
    entries: Sequence[tuple[Sequence[int], int, int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """``entries``: per sequence ``(block_table, num_computed, num_new)``, decodes (``num_new == 1``)
    first. Returns the metadata and the ``[T]`` int64 positions of the step's tokens.

    A block table must cover ``num_computed + num_new`` tokens."""
    if not entries:
        raise ValueError("a step needs at least one sequence")
    slots: list[int] = []
    positions: list[int] = []
    seq_lens: list[int] = []
    qsl = [0]
    num_decodes = 0
    seen_prefill = False
    for i, (table, start, n) in enumerate(entries):
        if n < 1 or start < 0:
            raise ValueError(f"sequence {i}: num_new must be >= 1 and num_computed >= 0, got {n} and {start}")
        end = start + n
        if len(table) * block_size < end:
            raise ValueError(f"sequence {i}: block table of {len(table)} blocks cannot hold {end} tokens")
        if n == 1 and not seen_prefill:
            num_decodes += 1
        else:
            seen_prefill = True
        positions.extend(range(start, end))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        seq_lens.append(end)
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t, _, _ in entries)
    tables = [list(t) + [0] * (width - len(t)) for t, _, _ in entries]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        num_decodes=num_decodes,
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)
