"""Turns a scheduler step into batched forward passes and one sampling call.

On CPU with ``workers > 1`` a step's sequences are split into that many micro-batches, each run
single-threaded on its own Python thread (torch ops release the GIL). Small decode GEMMs do not
scale across OpenMP threads; whole micro-batches on separate cores do. A step with one sequence runs
as one batch with ``workers`` intra-op threads instead.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from llmbus.engine.attention import AttentionBackend, AttentionMetadata, build_attention_metadata
from llmbus.engine.sampler import Sampler
from llmbus.engine.scheduler import ScheduledSeq, SchedulerOutput
from llmbus.engine.sequence import Sequence, TokenLogprob
from llmbus.kv.layout import KVLayout


@dataclass
class _Batch:
    ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # rows of the batch whose hidden state is sampled
    sample_seqs: list[Sequence]


class ModelRunner:
    """Owns the paged KV cache (one opaque object per layer) and runs the model over it."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: KVLayout,
        backend: AttentionBackend,
        num_blocks: int,
        device: torch.device,
        workers: int = 1,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.model = model
        self.layout = layout
        self.backend = backend
        self.num_blocks = num_blocks
        self.device = device
        self.kv_caches = backend.allocate_cache(layout, num_blocks, device)
        self.sampler = Sampler()
        self.workers = workers if device.type == "cpu" else 1
        self._pool = ThreadPoolExecutor(self.workers - 1, thread_name_prefix="microbatch") if self.workers > 1 else None
        self._threads = torch.get_num_threads()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, TokenLogprob | None]]:
        """Run every scheduled chunk; return the sampled token of each entry with ``sample=True``."""
        groups = self._split(out.scheduled)
        batches = [self._prepare(g) for g in groups]
        if len(batches) == 1:
            self._set_threads(self.workers)
            hidden = [self._forward(batches[0])]
        else:
            self._set_threads(1)
            futures = [self._pool.submit(self._forward_in_thread, b) for b in batches[1:]]
            hidden = [self._forward(batches[0])] + [f.result() for f in futures]
        seqs = [s for b in batches for s in b.sample_seqs]
        if not seqs:
            return {}
        rows = [h for h in hidden if h is not None]
        logits = self.model.compute_logits(torch.cat(rows) if len(rows) > 1 else rows[0])
        result = self.sampler(logits, seqs)
        return {seq.request_id: (tok, lp) for seq, tok, lp in zip(seqs, result.token_ids, result.logprobs)}

    def _set_threads(self, n: int) -> None:
        if self.workers > 1 and self._threads != n:
            torch.set_num_threads(n)
            self._threads = n

    def _split(self, entries: list[ScheduledSeq]) -> list[list[ScheduledSeq]]:
        """Balance entries over ``workers`` micro-batches by estimated cost (new tokens plus the
        context they attend to); each keeps the decodes-first order attention metadata needs."""
        if self.workers == 1 or len(entries) < 2:
            return [entries]
        n = min(self.workers, len(entries))
        loads = [0.0] * n
        groups: list[list[ScheduledSeq]] = [[] for _ in range(n)]
        for e in sorted(entries, key=lambda e: -_cost(e)):
            i = loads.index(min(loads))
            groups[i].append(e)
            loads[i] += _cost(e)
        return [sorted(g, key=lambda e: e.num_new_tokens != 1) for g in groups]

    def _forward_in_thread(self, batch: _Batch) -> torch.Tensor | None:
        with torch.inference_mode():  # NOTE: inference mode is per thread
            return self._forward(batch)

    def _forward(self, batch: _Batch) -> torch.Tensor | None:
        hidden = self.model(batch.ids, batch.positions, self.kv_caches, batch.meta)
        if not batch.sample_rows:
            return None
        return hidden[torch.tensor(batch.sample_rows, device=self.device)]

    def _prepare(self, entries: list[ScheduledSeq]) -> _Batch:
        input_ids: list[int] = []
        spans: list[tuple[list[int], int, int]] = []  # (block table, num computed, num new)
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        rows = 0
        for entry in entries:
            seq, n = entry.seq, entry.num_new_tokens
            start = seq.num_computed_tokens
            if n == 1:
                input_ids.append(_token_at(seq, start))
            else:
                input_ids.extend(_tokens_between(seq, start, start + n))
            spans.append((seq.block_table, start, n))
            rows += n
            if entry.sample:
                sample_rows.append(rows - 1)
                sample_seqs.append(seq)
        meta, positions = build_attention_metadata(spans, self.layout.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        return _Batch(ids, positions, meta, sample_rows, sample_seqs)


def _cost(entry: ScheduledSeq) -> float:
    return entry.num_new_tokens + (entry.seq.num_computed_tokens + entry.num_new_tokens) / 16


def _token_at(seq, index: int) -> int:
    n = seq.num_prompt_tokens
    return seq.prompt_token_ids[index] if index < n else seq.output_token_ids[index - n]


def _tokens_between(seq, start: int, end: int) -> list[int]:
    n = seq.num_prompt_tokens
    if end <= n:
        return seq.prompt_token_ids[start:end]
    return seq.all_token_ids[start:end]
