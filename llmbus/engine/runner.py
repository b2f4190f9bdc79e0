"""Turns a scheduler step into one batched forward pass and a sampling call."""

from __future__ import annotations

import torch

from llmbus.engine.attention import AttentionBackend, AttentionMetadata
from llmbus.engine.sampler import Sampler
from llmbus.engine.scheduler import SchedulerOutput
from llmbus.engine.sequence import TokenLogprob
from llmbus.kv.layout import KVLayout


class ModelRunner:
    """Owns the paged KV cache (one opaque object per layer) and runs the model over it."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: KVLayout,
        backend: AttentionBackend,
        num_blocks: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.layout = layout
        self.backend = backend
        self.num_blocks = num_blocks
        self.device = device
        self.kv_caches = backend.allocate_cache(layout, num_blocks, device)
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, TokenLogprob | None]]:
        """Run every scheduled chunk; return the sampled token of each entry with ``sample=True``."""
        bs = self.layout.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_seqs = []
        num_decodes = 0
        for entry in out.scheduled:
            seq, n = entry.seq, entry.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if n == 1:
                num_decodes += 1
                input_ids.append(_token_at(seq, start))
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(_tokens_between(seq, start, end))
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            qsl.append(qsl[-1] + n)
            tables.append(table)
            if entry.sample:
                sample_rows.append(qsl[-1] - 1)
                sample_seqs.append(seq)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            num_decodes=num_decodes,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        hidden = self.model(ids, pos, self.kv_caches, meta)
        if not sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        result = self.sampler(logits, sample_seqs)
        return {
            seq.request_id: (tok, lp)
            for seq, tok, lp in zip(sample_seqs, result.token_ids, result.logprobs)
        }


def _token_at(seq, index: int) -> int:
    n = seq.num_prompt_tokens
    return seq.prompt_token_ids[index] if index < n else seq.output_token_ids[index - n]


def _tokens_between(seq, start: int, end: int) -> list[int]:
    n = seq.num_prompt_tokens
    if end <= n:
        return seq.prompt_token_ids[start:end]
    return seq.all_token_ids[start:end]
