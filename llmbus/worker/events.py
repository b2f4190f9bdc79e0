"""Turning engine step outputs into the TokenEvents the gateway reads, and a cache's changes into
the KV events kvpool's prefix index reads."""

from __future__ import annotations

from llmbus.engine.engine import StepOutput
from llmbus.protocol import LogprobEntry, TokenEvent
from llmbus.protocol.messages import BlockRemovedEvent, BlockStoredEvent, KVEvents


def _entries(logprobs) -> list[LogprobEntry] | None:
    if logprobs is None:
        return None
    return [LogprobEntry(lp.token_id, lp.logprob, [tuple(t) for t in lp.top]) for lp in logprobs]


def token_event(out: StepOutput, seq: int, worker: str, finish_reason: str | None) -> TokenEvent:
    return TokenEvent(
        request_id=out.request_id,
        seq=seq,
        token_ids=list(out.new_token_ids),
        logprobs=_entries(out.logprobs),
        finish_reason=finish_reason,
        error=out.error or None,
        prompt_tokens=out.num_prompt_tokens,
        cached_tokens=out.num_cached_tokens,
        completion_tokens=out.num_output_tokens,
        worker=worker,
        prompt_logprobs=_entries(out.prompt_logprobs),
    )


def cache_events(worker: str, changes: list[tuple[bool, bytes, bytes | None]], block_size: int) -> KVEvents | None:
    """A batch of ``BlockManager.changes`` as one KVEvents of ``worker``'s tier 0, or None when
    empty. A hash's last change wins (kvpool applies a batch's stored blocks before its removed
    ones, so a block evicted and cached again within the batch must arrive as stored only), and
    stored blocks that chain on from each other travel as one event."""
    last = {h: i for i, (_, h, _) in enumerate(changes)}
    stored: list[BlockStoredEvent] = []
    removed: list[bytes] = []
    for i, (added, h, parent) in enumerate(changes):
        if last[h] != i:
            continue
        if not added:
            removed.append(h)
        elif stored and parent is not None and stored[-1].block_hashes[-1] == parent:
            stored[-1].block_hashes.append(h)
        else:
            stored.append(BlockStoredEvent([h], parent, block_size, "t0", worker))
    if not stored and not removed:
        return None
    return KVEvents(worker, stored, [BlockRemovedEvent(removed, "t0", worker)] if removed else [])
