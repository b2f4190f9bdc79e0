"""Turning engine step outputs into the TokenEvents the gateway reads."""

from __future__ import annotations

from llmbus.engine.engine import StepOutput
from llmbus.protocol import LogprobEntry, TokenEvent


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
        prompt_tokens=out.num_prompt_tokens,
        cached_tokens=out.num_cached_tokens,
        completion_tokens=out.num_output_tokens,
        worker=worker,
        prompt_logprobs=_entries(out.prompt_logprobs),
    )
