"""A request as the engine tracks it. Pure Python: the scheduler and block manager use it.

``num_computed_tokens`` is the one progress counter: how many of ``all_token_ids`` have KV in the
cache. It survives preemption (reset to 0 on recompute) and the prefill -> decode handoff.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from llmbus.engine.sampling_params import SamplingParams

_arrivals = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-n (token id, logprob), most likely first


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str = ""  # tenant salt for prefix hashing; set by the server, never by a client
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # params.prompt_logprobs: entry i for prompt token i+1 (the first token has none), filled as
    # the prefill's chunks are computed
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks so far
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_preemptions: int = 0
    priority: int = 0  # smaller first: admitted before, and preempted after, any larger one
    arrival: int = field(default_factory=lambda: next(_arrivals))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
