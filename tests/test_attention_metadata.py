"""build_attention_metadata against a per-token statement of what each field holds."""

import random

import pytest
import torch

from llmbus.engine.attention import build_attention_metadata


def _expected(entries, bs, tails):
    slots, positions, tail_slots, last_rows, lens, qsl = [], [], [], [], [], [0]
    for (table, start, n), rows in zip(entries, tails or [None] * len(entries)):
        for p in range(start, start + n):
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            if rows is not None:
                row = rows[0] if p // bs == start // bs else rows[1]
                tail_slots.append(row * bs + p % bs if row >= 0 else -1)
        if rows is not None:
            last_rows.append(rows[0] if (start + n - 1) // bs == start // bs else rows[1])
        lens.append(start + n)
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t, _, _ in entries)
    tables = [list(t) + [0] * (width - len(t)) for t, _, _ in entries]
    return slots, positions, tail_slots, last_rows, lens, qsl, tables


@pytest.mark.parametrize("seed", range(6))
def test_fields_hold_each_tokens_slot_position_and_tail(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    entries, tails = [], []
    num_decodes = rng.randint(0, 5)
    for i in range(rng.randint(1, 9)):
        n = 1 if i < num_decodes else rng.randint(2, 40)
        start = rng.randint(0, 70)
        table = rng.sample(range(5000), -(-(start + n) // bs) + rng.randint(0, 2))
        entries.append((table, start, n))
        tails.append((rng.randint(-1, 7), rng.randint(8, 15)))
    for with_tails in (False, True):
        meta, positions = build_attention_metadata(entries, bs, "cpu", tails if with_tails else None)
        slots, pos, tail_slots, last_rows, lens, qsl, tables = _expected(entries, bs, tails if with_tails else None)
        assert positions.dtype == meta.slot_mapping.dtype == torch.int64
        assert meta.block_tables.dtype == meta.seq_lens.dtype == meta.query_start_loc.dtype == torch.int32
        assert positions.tolist() == pos and meta.slot_mapping.tolist() == slots
        assert meta.block_tables.tolist() == tables and meta.block_tables.is_contiguous()
        assert meta.seq_lens.tolist() == lens and meta.query_start_loc.tolist() == qsl
        assert meta.num_decodes == min(num_decodes, len(entries))
        assert meta.max_decode_len == max(lens[: meta.num_decodes], default=0)
        assert meta.max_query_len == max(n for _, _, n in entries)
        if with_tails:
            assert meta.tail_slots.tolist() == tail_slots and meta.tail_rows.tolist() == last_rows
            assert meta.tail_slots.dtype == torch.int64 and meta.tail_rows.dtype == torch.int32
        else:
            assert meta.tail_slots is None and meta.tail_rows is None


def test_every_field_starts_16_byte_aligned():
    """The fields share two buffers; each starts aligned as a tensor of its own would, since
    Triton compiles a kernel variant per pointer alignment (odd offsets would compile new ones
    in the middle of serving)."""
    for b, width, n in [(1, 1, 1), (3, 5, 1), (5, 3, 7), (7, 9, 2)]:
        entries = [(list(range(i, i + width)), 0, n) for i in range(b)]
        meta, positions = build_attention_metadata(entries, 16, "cpu", [(0, 1)] * b)
        fields = [meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.tail_slots,
                  meta.tail_rows, positions]  # fmt: skip
        assert [f.data_ptr() % 16 for f in fields] == [0] * len(fields), (b, width, n)
