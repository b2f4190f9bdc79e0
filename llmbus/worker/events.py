"""Turning engine step outputs into the TokenEvents the gateway reads."""

from __future__ import annotations

from llmbus.engine.engine import StepOutput
from llmbus.protocol import LogprobEntry, TokenEvent


def token_event(out: StepOutput, seq: int, worker: str, finish_reason: str | None) -> TokenEvent:
    logprobs = None
    if out.logprobs is not None:
        logprobs = [LogprobEntry(lp.token_id, lp.logprob, [tuple(t) for t in lp.top]) for lp in out.logprobs]
    return TokenEvent(
        request_id=out.request_id,
        seq=seq,
        token_ids=list(out.new_token_ids),
        logprobs=logprobs,
        finish_reason=finish_reason,
        prompt_tokens=out.num_prompt_tokens,
        cached_tokens=out.num_cached_tokens,
        completion_tokens=out.num_output_tokens,
        worker=worker,
    )
