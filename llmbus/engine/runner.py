"""Turns a scheduler step into batched forward passes and one sampling call.

On CPU a step runs as one batch whose ops use the process's torch intra-op threads: large GEMMs
split their output columns across cores, so each core streams only its share of the weights.
``micro_batches > 1`` instead splits a step's sequences into that many micro-batches, each run
single-threaded on its own Python thread (torch ops release the GIL). Measured on 2 cores
(docs/benchmarks.md): intra-op threads win on the demo models (bf16 GQA: 1.2-1.4x at decode
batch 8-64), where every micro-batch re-reading all weights dominates; micro-batches win on an
attention-heavy fp32 multi-head model (1.2x), whose KV traffic dwarfs its weights.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from llmbus.engine.attention import AttentionBackend, AttentionMetadata, build_attention_metadata, seals_and_starts
from llmbus.engine.graphs import DecodeGraphs
from llmbus.engine.sampler import Sampler, logprob_entries
from llmbus.engine.scheduler import ScheduledSeq, SchedulerOutput
from llmbus.engine.sequence import Sequence, TokenLogprob
from llmbus.kv.layout import KVLayout


PROMPT_LOGITS_ROWS = 256  # prompt positions scored per LM-head call


@dataclass
class _Batch:
    ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # rows of the batch whose hidden state is sampled
    sample_seqs: list[Sequence]
    # per sampled row, how many outputs ahead of its sequence's it draws (0 but for the rows
    # after a draft's first, llmbus.engine.speculative)
    sample_ahead: list[int] = field(default_factory=list)
    # rows whose logits score the next prompt token (params.prompt_logprobs): (row, seq, token)
    prompt_rows: list[tuple[int, Sequence, int]] = field(default_factory=list)


class TailRows:
    """Which sequence holds which exact tail rows of the cache (``llmbus.kv.formats``).

    A sequence takes two rows when first scheduled and gives them back when its blocks are freed
    (finish, abort, preemption, handoff: ``BlockManager.on_free``). Its filling block's keys and
    values live in its *current* row. Two, because one step may both seal that block (reading the
    row) and start the next (writing its first tokens): then those go to the other row, which
    becomes current; the kernel's programs run in parallel, so sharing one row would race. With no
    rows left a sequence gets -1 and reads and seals its blocks from their per-token codes.

    A handed-over sequence's filling block may come with its exact keys and values (``received``:
    what the prefill worker's row held); its row starts from them when it is first scheduled,
    else from the block's per-token codes."""

    def __init__(self, num_rows: int) -> None:
        self._free: deque[int] = deque(range(num_rows - num_rows % 2))
        self._held: dict[str, list[int]] = {}  # request id -> [current row, other row]
        self.received: dict[str, torch.Tensor] = {}  # request id -> [layers, 2, n, H, D] exact tail

    def rows_for(self, request_id: str, start: int, num_new: int, block_size: int) -> tuple[int, int, bool]:
        """``(row of the first new token's block, row of later blocks, newly taken)`` for a step
        computing tokens ``[start, start + num_new)``; ``(-1, -1, False)`` when no rows are left."""
        pair = self._held.get(request_id)
        new = pair is None
        if new:
            if not self._free:
                return -1, -1, False
            pair = self._held[request_id] = [self._free.popleft(), self._free.popleft()]
        if seals_and_starts(start, start + num_new, block_size):
            pair.reverse()  # NOTE: seals the current row's block and starts another: switch rows
            return pair[1], pair[0], new
        return pair[0], pair[0], new

    def snapshot(self) -> tuple:
        """Who holds which rows, and the tails received, as of now: ``restore`` puts it back."""
        return deque(self._free), {rid: list(pair) for rid, pair in self._held.items()}, dict(self.received)

    def restore(self, snapshot: tuple) -> None:
        """Put back a ``snapshot``, which is then this object's own (each is restored at most once)."""
        self._free, self._held, self.received = snapshot

    def current(self, request_id: str) -> int | None:
        """The row holding ``request_id``'s filling block, or None (it holds no rows)."""
        pair = self._held.get(request_id)
        return None if pair is None else pair[0]

    def release(self, seq: Sequence) -> None:
        """Give back ``seq``'s rows, if it holds them, and drop a tail it received; idempotent."""
        self.received.pop(seq.request_id, None)
        pair = self._held.pop(seq.request_id, None)
        if pair is not None:
            self._free.extend(pair)

    @property
    def num_held(self) -> int:
        """Rows held by sequences."""
        return 2 * len(self._held)


class ModelRunner:
    """Owns the paged KV cache (one opaque object per layer) and runs the model over it.
    ``tail_rows > 0``: the cache keeps that many exact tail rows, two per running sequence.
    ``decode_graphs > 0``: decode-only steps of up to that many sequences (of up to
    ``max_model_len`` tokens) run over ``llmbus.engine.graphs.DecodeGraphs``' static buffers,
    recorded as CUDA graphs on CUDA (eagerly elsewhere); the cache then holds one block more than
    ``num_blocks``, where padding rows write."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: KVLayout,
        backend: AttentionBackend,
        num_blocks: int,
        device: torch.device,
        micro_batches: int = 1,
        tail_rows: int = 0,
        decode_graphs: int = 0,
        max_model_len: int = 0,
    ) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.model = model
        self.layout = layout
        self.backend = backend
        self.num_blocks = num_blocks
        self.device = device
        sink = 1 if decode_graphs else 0
        self.kv_caches = backend.allocate_cache(layout, num_blocks + sink, device, tail_rows)
        self.tails = TailRows(tail_rows) if tail_rows else None
        self.graphs = None
        if decode_graphs:
            if max_model_len < 1:
                raise ValueError("decode_graphs needs max_model_len")
            self.graphs = DecodeGraphs(model, self.kv_caches, layout.block_size, decode_graphs, max_model_len,
                                       num_blocks, device, tail_rows > 0, record=device.type == "cuda")
            if not self.graphs.capture():
                self.graphs = None  # the dynamic path; the sink block stays unused
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # what the failed recording's pool held
        self.sampler = Sampler()
        self.micro_batches = micro_batches if device.type == "cpu" else 1
        self._pool = (ThreadPoolExecutor(self.micro_batches - 1, thread_name_prefix="microbatch")
                      if self.micro_batches > 1 else None)
        self._threads = torch.get_num_threads()  # intra-op threads for one-batch steps

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, list[tuple[int, TokenLogprob | None]]]:
        """Run every scheduled chunk; return the tokens of each entry with ``sample=True``: the one
        sampled, or for an entry with a draft, the draft's tokens its rows confirmed (each the
        token sampled at the row before) and then the first sampled token that differs from the
        draft, or the one sampled after all of it."""
        if self.graphs is not None and self._graphable(out.scheduled):
            # NOTE: metadata built on the host, copied into the recording's buffers
            batches = [self._prepare(out.scheduled, torch.device("cpu"))]
            batch = batches[0]
            hidden = [self._rows(self.graphs.run(batch.ids, batch.positions, batch.meta), batch)]
        else:
            batches = [self._prepare(g) for g in self._split(out.scheduled)]
            hidden = self._forward_all(batches)
        for batch, (_, prompt) in zip(batches, hidden):
            if prompt is not None:
                self._score_prompt(prompt, batch.prompt_rows)
        seqs = [s for b in batches for s in b.sample_seqs]
        ahead = [a for b in batches for a in b.sample_ahead]
        rows = self._sample([h for h, _ in hidden if h is not None], seqs, ahead)
        sampled: dict[str, list[tuple[int, TokenLogprob | None]]] = {}
        drafts = {e.seq.request_id: e.draft for e in out.scheduled if e.draft}
        for seq, row in zip(seqs, rows):
            got = sampled.setdefault(seq.request_id, [])
            draft = drafts.get(seq.request_id, ())
            if not got or len(got) <= len(draft) and got[-1][0] == draft[len(got) - 1]:
                got.append(row)  # NOTE: rows after the first differing token are dropped
        return sampled

    def _score_prompt(self, hidden: torch.Tensor, rows: list[tuple[int, Sequence, int]]) -> None:
        """Append each prompt row's entry to its sequence's ``prompt_logprobs``, a few hundred rows
        of logits at a time (a long prompt's [T, vocab] at once would be gigabytes)."""
        for start in range(0, len(rows), PROMPT_LOGITS_ROWS):
            part = rows[start : start + PROMPT_LOGITS_ROWS]
            logits = self.model.compute_logits(hidden[start : start + len(part)])
            targets = [t for _, _, t in part]
            tokens = torch.tensor(targets, dtype=torch.int64, device=logits.device)
            for (_, seq, _), entry in zip(part, logprob_entries(logits, tokens, targets,
                                                                [s.params.prompt_logprobs for _, s, _ in part])):
                seq.prompt_logprobs.append(entry)

    def _graphable(self, entries: list[ScheduledSeq]) -> bool:
        """Whether a step runs recorded: decode rows only, within the recorded sizes and lengths."""
        return (bool(entries) and all(e.decodes for e in entries)
                and self.graphs.fits(sum(e.num_new_tokens for e in entries), max(len(e.seq.block_table) for e in entries)))

    def _sample(self, rows: list[torch.Tensor], seqs: list[Sequence], ahead: list[int]) -> list[tuple[int, TokenLogprob | None]]:
        """Each sampled row's token and logprob entry."""
        if not seqs:
            return []
        logits = self.model.compute_logits(torch.cat(rows) if len(rows) > 1 else rows[0])
        result = self.sampler(logits, seqs, ahead if any(ahead) else None)
        return list(zip(result.token_ids, result.logprobs))

    def _set_threads(self, n: int) -> None:
        if self.micro_batches > 1 and torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def _split(self, entries: list[ScheduledSeq]) -> list[list[ScheduledSeq]]:
        """Balance entries over ``micro_batches`` groups by estimated cost (new tokens plus the
        context they attend to); each keeps the decodes-first order attention metadata needs."""
        if self.micro_batches == 1 or len(entries) < 2:
            return [entries]
        n = min(self.micro_batches, len(entries))
        loads = [0.0] * n
        groups: list[list[ScheduledSeq]] = [[] for _ in range(n)]
        for e in sorted(entries, key=lambda e: -_cost(e)):
            i = loads.index(min(loads))
            groups[i].append(e)
            loads[i] += _cost(e)
        return [sorted(g, key=lambda e: not e.decodes) for g in groups]

    def _forward_all(self, batches: list[_Batch]) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Each batch's sampled and prompt rows: one batch on the intra-op threads, micro-batches one
        a thread."""
        if len(batches) == 1:
            self._set_threads(self._threads)
            return [self._forward(batches[0])]
        self._set_threads(1)
        futures = [self._pool.submit(self._forward_in_thread, b) for b in batches[1:]]
        try:
            first = self._forward(batches[0])
        finally:  # NOTE: none may still write the cache once this returns or raises (a step run again)
            wait(futures)
        return [first] + [f.result() for f in futures]

    def _forward_in_thread(self, batch: _Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        with torch.inference_mode():  # NOTE: inference mode is per thread
            return self._forward(batch)

    def _forward(self, batch: _Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._rows(self.model(batch.ids, batch.positions, self.kv_caches, batch.meta), batch)

    def _rows(self, hidden: torch.Tensor, batch: _Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rows of ``hidden`` the step samples from, and those that score prompt tokens."""
        prompt = None
        if batch.prompt_rows:
            prompt = hidden[torch.tensor([r for r, _, _ in batch.prompt_rows], dtype=torch.int64, device=hidden.device)]
        return self._sampled_rows(hidden, batch), prompt

    def _sampled_rows(self, hidden: torch.Tensor, batch: _Batch) -> torch.Tensor | None:
        """The rows of ``hidden`` the step samples from (None: none, e.g. one-token prompt chunks
        before their last); all of them as they are, the common decode case."""
        if not batch.sample_rows:
            return None
        if batch.sample_rows == list(range(hidden.shape[0])):
            return hidden
        return hidden[torch.tensor(batch.sample_rows, dtype=torch.int64, device=self.device)]

    def _prepare(self, entries: list[ScheduledSeq], device: torch.device | None = None) -> _Batch:
        input_ids: list[int] = []
        spans: list[tuple[list[int], int, int]] = []  # (block table, num computed, num new)
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        sample_ahead: list[int] = []
        prompt_rows: list[tuple[int, Sequence, int]] = []
        tail_rows: list[tuple[int, int]] | None = [] if self.tails is not None else None
        rows = 0
        for entry in entries:
            seq, n = entry.seq, entry.num_new_tokens
            start = seq.num_computed_tokens
            if entry.draft:  # a decode row for its last token and one for each drafted token
                if tail_rows is not None:
                    raise ValueError(f"{seq.request_id}: drafts need a KV format that rewrites slots, not tail rows")
                input_ids.append(_token_at(seq, start))
                input_ids.extend(entry.draft)
                for j in range(n):
                    spans.append((seq.block_table, start + j, 1))
                    sample_rows.append(rows + j)
                    sample_seqs.append(seq)
                    sample_ahead.append(j)
                rows += n
                continue
            if seq.params.prompt_logprobs is not None:
                # position p's logits score prompt token p + 1; each once (not again after a preemption)
                first, end = max(start, len(seq.prompt_logprobs)), min(start + n, seq.num_prompt_tokens - 1)
                prompt_rows.extend((rows + p - start, seq, seq.prompt_token_ids[p + 1]) for p in range(first, end))
            if tail_rows is not None:
                tail_rows.append(self._tail_rows(seq, start, n))
            if n == 1:
                input_ids.append(_token_at(seq, start))
            else:
                input_ids.extend(_tokens_between(seq, start, start + n))
            spans.append((seq.block_table, start, n))
            rows += n
            if entry.sample:
                sample_rows.append(rows - 1)
                sample_seqs.append(seq)
                sample_ahead.append(0)
        device = device or self.device
        meta, positions = build_attention_metadata(spans, self.layout.block_size, device, tail_rows)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
        return _Batch(ids, positions, meta, sample_rows, sample_seqs, sample_ahead, prompt_rows)

    def _tail_rows(self, seq: Sequence, start: int, n: int) -> tuple[int, int]:
        """``seq``'s tail rows for this step; newly taken ones start from what its filling block
        already holds (written elsewhere: a handoff): its exact keys and values if they came with
        it (``TailRows.received``), else its per-token codes."""
        bs = self.layout.block_size
        first, later, new = self.tails.rows_for(seq.request_id, start, n, bs)
        if new and start % bs:
            # NOTE: import_sequence checked that a received tail fills the block up to start
            exact = self.tails.received.pop(seq.request_id, None)
            for layer, cache in enumerate(self.kv_caches):
                if exact is not None:
                    rows = slice(first * bs, first * bs + start % bs)
                    cache.k_tail[rows] = exact[layer, 0]
                    cache.v_tail[rows] = exact[layer, 1]
                else:
                    self.backend.fill_tail(cache, seq.block_table[start // bs], first)
        return first, later

    def exact_tail(self, request_id: str, num_tokens: int) -> torch.Tensor | None:
        """The exact keys and values of ``request_id``'s filling block's first ``num_tokens`` slots,
        ``[layers, 2, num_tokens, H, D]`` in the model dtype, from its current tail row; None when
        the cache keeps no rows or the sequence holds none."""
        row = self.tails.current(request_id) if self.tails is not None and num_tokens else None
        if row is None:
            return None
        rows = slice(row * self.layout.block_size, row * self.layout.block_size + num_tokens)
        return torch.stack([torch.stack((cache.k_tail[rows], cache.v_tail[rows])) for cache in self.kv_caches])


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
