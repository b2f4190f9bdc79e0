"""Continuous batching with chunked prefill and preemption by recompute. Pure Python state machine.

Each ``schedule()`` spends a token budget: first on running decodes, then on running prefills'
next chunks, then on admitting waiting sequences, in order of priority (smaller first), oldest first
within one. Preemption takes the running sequence of the largest priority, the newest among them.
The runner computes positions ``[seq.num_computed_tokens, + num_new_tokens)`` of every scheduled
entry; ``update()`` then advances the counters, appends sampled tokens and finishes sequences.

A sequence that can never run (a prompt longer than ``max_model_len``, or more tokens than the whole
block pool holds) is not left to wedge the queue: when it reaches the head of the waiting queue it is
finished with ``"length"``, reported in ``SchedulerOutput.rejected`` and returned by ``update()``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from llmbus.engine.block_manager import BlockManager
from llmbus.engine.sequence import Sequence, SequenceStatus, TokenLogprob


RIDE_ALONG_SCAN = 16  # waiting sequences a step looks at, out of turn, for one with a few tokens left


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # the per-step token budget
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk may use the whole remaining budget

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 1, got {value!r}")
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(
                f"SchedulerConfig.long_prefill_token_threshold must be an integer >= 0, got {t!r}"
            )
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(
                f"SchedulerConfig.enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}), or a long prompt could never be scheduled"
            )


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # computes positions [seq.num_computed_tokens, +num_new_tokens)
    sample: bool  # True when this chunk reaches the last known token -> sample a new token
    # a decode's speculative tokens (llmbus.engine.speculative): guesses of the tokens after its
    # last, computed after it in this step (num_new_tokens == 1 + len(draft)), each as a decode row
    draft: tuple[int, ...] = ()

    @property
    def decodes(self) -> bool:
        """Whether every token of the entry is computed as a one-token decode row."""
        return self.num_new_tokens == 1 or bool(self.draft)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # decodes first (one token, or one and a draft), then longer chunks
    preempted: list[Sequence]
    num_batched_tokens: int
    # Sequences that can never run (prompt longer than max_model_len, or more blocks than the whole
    # pool): finished with "length" without computing anything; update() returns them too.
    rejected: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # admission order
        self._by_id: dict[str, Sequence] = {}
        # speculative decoding (set by the engine): ``drafter(seq, share, most)`` is a decode's
        # draft ([] where it has none) of at most ``share`` tokens, or ``most`` for a sequence
        # whose drafts the drafter trusts. A step's decode rows (one a decode, one a drafted
        # token) stay within ``draft_max_rows``; the shares are the rows that fill the step's
        # last group of ``draft_row_group`` rows (a group costs about as much as its first row)
        self.drafter: Callable[[Sequence, int, int], list[int]] | None = None
        self.draft_max_rows = 0
        self.draft_row_group = 1

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def waiting_to_resume(self) -> bool:
        """Whether a sequence preempted for blocks waits to run again (it needs blocks first)."""
        return any(s.num_preemptions and not s.block_table for s in self._waiting)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (it may already hold blocks with computed KV, e.g. a handoff)."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        if seq.status is not SequenceStatus.WAITING:
            raise ValueError(
                f"sequence {seq.request_id!r} must be waiting to be added, it is {seq.status.value}"
            )
        if seq.num_prompt_tokens == 0:
            raise ValueError(f"sequence {seq.request_id!r} has an empty prompt")
        self._by_id[seq.request_id] = seq
        self._queue(seq, behind=True)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a waiting or running sequence with "abort" and free its blocks now."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return None
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return seq

    # --- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledSeq] = {}
        preempted: list[Sequence] = []

        def preempt_for(seq: Sequence) -> bool:
            """Preempt the newest running seq; False if that was ``seq`` itself."""
            nonlocal budget
            victim = max(self._running, key=_yields)
            entry = scheduled.pop(victim.request_id, None)
            if entry is not None:
                budget += entry.num_new_tokens
            self._preempt(victim)
            preempted.append(victim)
            return victim is not seq

        # Running sequences: decodes first, then unfinished prefills, by priority and age within each.
        order = sorted(self._running, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1, s.priority, s.arrival))
        spare = cheap = share = 0  # rows this step's drafts may still take; of them, those that fill its last group
        if self.drafter is not None:
            decodes = sum(1 for s in self._running if s.num_tokens - s.num_computed_tokens == 1)
            spare = self.draft_max_rows - decodes
            cheap = min(spare, -decodes % self.draft_row_group)
            share = max(1, cheap // max(1, decodes))  # each decode's, while they last
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:
                continue
            if spare > 0 and n == 1 and (entry := self._drafted(seq, budget, min(share, cheap), spare)) is not None:
                scheduled[seq.request_id] = entry
                budget -= entry.num_new_tokens
                spare -= len(entry.draft)
                cheap -= min(cheap, len(entry.draft))
                continue
            while not self.block_manager.allocate(seq, n):
                if not preempt_for(seq):
                    break
            else:
                scheduled[seq.request_id] = self._entry(seq, n)
                budget -= n

        # Waiting sequences, by priority then age (the queue's order); skip admission after a
        # preemption (the pool is full).
        # A sequence whose next uncached block a running prefill is computing right now waits a
        # step (or as many as that prefill takes) and then takes it, and every block after it the
        # two share, from the prefix cache instead of computing them again: n copies of one prompt
        # (a request's n choices) or a burst sharing a system prompt are prefilled once. It keeps
        # its place in the batch meanwhile: nothing behind it takes the last slot.
        rejected: list[Sequence] = []
        max_seqs = self.config.max_num_seqs
        pool_full = bool(preempted)
        bm = self.block_manager
        inflight: set[bytes] | None = None  # blocks running prefills will commit; built when first needed

        # First, out of turn: a waiting sequence among the next RIDE_ALONG_SCAN with at most a few
        # tokens left to compute (a prompt the prefix cache holds all but a few tokens of, an
        # imported handoff, a tiny prompt), up to a 16th of the budget in all, where it gets its
        # blocks without preempting. Its first token costs the step next to nothing; waiting its
        # turn behind prompts computed whole cost it their steps (a burst of 16 at 16 streams: the
        # cached prompts' first tokens came with the last uncached ones, at 757 ms, not ~60).
        # Not while a preempted sequence waits for blocks to resume.
        extra = min(budget, self.config.max_num_batched_tokens // 16)
        riders: dict[str, ScheduledSeq] = {}  # (after the others in the batch: its order stays FCFS)
        j = 0
        # NOTE: every sequence ahead of it keeps a batch slot (max_num_seqs): it takes none of theirs
        while (extra > 0 and not pool_full and j < min(len(self._waiting), RIDE_ALONG_SCAN)
               and len(self._running) + j < max_seqs and not self.waiting_to_resume()):  # fmt: skip
            seq = self._waiting[j]
            cached, first_uncached = bm.prefix_lookup(seq)
            remaining = seq.num_tokens - cached
            if self._chunk(remaining, extra) != remaining or self._never_fits(seq):  # (in one chunk, as capped)
                j += 1
                continue
            if first_uncached is not None:
                if inflight is None:
                    inflight = {h for s in self._running if s.num_tokens - s.num_computed_tokens > 1
                                for h in bm.pending_hashes(s)}  # fmt: skip
                if first_uncached in inflight:  # a running prefill computes it: it waits for that
                    j += 1
                    continue
            if not bm.allocate(seq, remaining):
                break
            riders[seq.request_id] = self._admit(j, remaining)
            budget -= remaining
            extra -= remaining
            if inflight is not None:
                inflight.update(bm.pending_hashes(seq))

        i = 0  # NOTE: == the sequences skipped, waiting for a prefill: they keep their batch slots
        while i < len(self._waiting) and budget > 0 and not pool_full and len(self._running) + i < max_seqs:
            seq = self._waiting[i]
            if self._never_fits(seq):
                del self._waiting[i]
                self.finish(seq, "length")
                rejected.append(seq)
                continue
            cached, first_uncached = bm.prefix_lookup(seq)
            if first_uncached is not None:
                if inflight is None:
                    inflight = {h for s in self._running if s.num_tokens - s.num_computed_tokens > 1
                                for h in bm.pending_hashes(s)}  # fmt: skip
                if first_uncached in inflight:
                    i += 1
                    continue
            remaining = seq.num_tokens - cached
            n = self._chunk(remaining, budget)
            if n == 0:
                break  # strict FCFS: the head waits for budget
            if not bm.allocate(seq, n):
                if self._running or not self._release_waiting(seq, preempted):
                    break  # strict FCFS: the head waits for blocks
                continue
            scheduled[seq.request_id] = self._admit(i, n)
            budget -= n
            if inflight is not None:
                inflight.update(bm.pending_hashes(seq))

        scheduled.update(riders)
        entries = sorted(scheduled.values(), key=lambda e: not e.decodes)
        return SchedulerOutput(
            scheduled=entries,
            preempted=preempted,
            num_batched_tokens=sum(e.num_new_tokens for e in entries),
            rejected=rejected,
        )

    def _drafted(self, seq: Sequence, budget: int, share: int, most: int) -> ScheduledSeq | None:
        """A decode with a draft, its blocks allocated; None where it has none, or where the
        draft's blocks are not free (it then runs as a plain decode: a draft preempts nobody).
        The draft leaves room for the token the step samples after it, within ``max_tokens``,
        the context and the budget, and takes at most ``share`` rows, or ``most`` where the
        drafter trusts the sequence's drafts; a sequence's first output token is never drafted."""
        room = min(budget, seq.params.max_tokens - len(seq.output_token_ids),
                   self.config.max_model_len - seq.num_tokens) - 1  # fmt: skip
        room = min(room, most)
        if room < 1 or not seq.output_token_ids:
            return None
        draft = self.drafter(seq, min(room, share), room)[:room]
        if not draft or not self.block_manager.allocate(seq, 1 + len(draft)):
            return None
        return ScheduledSeq(seq=seq, num_new_tokens=1 + len(draft), sample=True, draft=tuple(draft))

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to compute now: the budget-limited chunk, or 0 when the rest cannot be split."""
        if remaining <= 1:
            return min(remaining, budget)
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        n = min(remaining, budget)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _never_fits(self, seq: Sequence) -> bool:
        # NOTE: the engine rejects these up front; this keeps a stray one from wedging the queue
        # (it would wait forever at the head). It also ends a sequence that preempted itself
        # because its own context outgrew the whole pool.
        bm = self.block_manager
        too_long = seq.num_prompt_tokens > self.config.max_model_len
        return too_long or bm.blocks_for(seq.num_tokens) > bm.num_blocks

    def _admit(self, at: int, n: int) -> ScheduledSeq:
        """Move waiting sequence ``at`` (its blocks allocated) to running, computing ``n`` tokens."""
        seq = self._waiting[at]
        del self._waiting[at]
        seq.status = SequenceStatus.RUNNING
        self._running.append(seq)
        return self._entry(seq, n)

    @staticmethod
    def _entry(seq: Sequence, n: int) -> ScheduledSeq:
        return ScheduledSeq(seq=seq, num_new_tokens=n, sample=seq.num_computed_tokens + n == seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self._drop_kv(seq)
        seq.status = SequenceStatus.WAITING
        self._queue(seq, behind=False)

    def _queue(self, seq: Sequence, *, behind: bool) -> None:
        """Put ``seq`` in the waiting queue among its priority's: after them (``behind``: a new
        sequence) or before them (preempted: it resumes first)."""
        waiting = self._waiting
        if not waiting or (behind and waiting[-1].priority <= seq.priority):
            waiting.append(seq)  # (the common case: one priority)
            return
        i = next((i for i, s in enumerate(waiting) if s.priority > seq.priority or not behind and s.priority == seq.priority),
                 len(waiting))  # fmt: skip
        waiting.insert(i, seq)

    def _drop_kv(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks; it computes its tokens again when it next runs."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1

    def _release_waiting(self, head: Sequence, preempted: list[Sequence]) -> bool:
        """Nothing runs and ``head`` does not fit: free the blocks of the newest waiting sequence
        behind it that holds some (an imported handoff, queued with its KV) and say whether one did.

        NOTE: without this the queue wedges for good. A running sequence that outgrew the pool
        preempted itself to the head, blockless; handoffs queued behind it hold blocks; once the
        rest finish, what is free can be less than the head needs, and nothing else frees blocks.
        The victim recomputes its tokens when its turn comes, as a preempted sequence does."""
        holders = [s for s in self._waiting if s is not head and s.block_table]
        if not holders:
            return False
        victim = max(holders, key=_yields)
        self._drop_kv(victim)
        preempted.append(victim)
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence with ``reason`` and free its blocks now."""
        self._by_id.pop(seq.request_id, None)
        if seq in self._running:
            self._running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # --- after the step -----------------------------------------------------------------------

    def update(
        self, output: SchedulerOutput, sampled: dict[str, list[tuple[int, TokenLogprob | None]]]
    ) -> list[Sequence]:
        """Apply a computed step; return the sequences that finished (including ``output.rejected``).
        ``sampled``: the tokens of each entry that samples, in order: one, or for an entry with a
        draft the draft's tokens the step confirmed, then the one it sampled after them."""
        finished: list[Sequence] = list(output.rejected)
        for entry in output.scheduled:
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted between schedule() and update()
            if not entry.draft:
                seq.num_computed_tokens += entry.num_new_tokens
                self.block_manager.commit(seq)
            if not entry.sample:
                continue
            tokens = sampled.get(seq.request_id)
            if not tokens:
                raise ValueError(f"no sampled token for {seq.request_id!r}, which was scheduled to sample")
            if len(tokens) > 1 + len(entry.draft):
                raise ValueError(f"{len(tokens)} sampled tokens for {seq.request_id!r}, which was scheduled "
                                 f"to sample one after a draft of {len(entry.draft)}")  # fmt: skip
            reason = None
            for token, logprob in tokens:
                seq.output_token_ids.append(token)
                if logprob is not None:
                    seq.output_logprobs.append(logprob)
                if entry.draft:  # NOTE: the input before this token is now computed, as confirmed
                    seq.num_computed_tokens += 1
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    break
            if entry.draft:
                self.block_manager.commit(seq)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (token in seq.eos_token_ids and not params.ignore_eos):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None


def _yields(seq: Sequence) -> tuple[int, int]:
    """Preemption's order: the largest priority first, the newest first within one."""
    return seq.priority, seq.arrival
