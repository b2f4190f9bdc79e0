"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmbus.guide.grammar import check_guide


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 (or -1) disables
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: sampled token's logprob plus top-n
    # (token id, bias) pairs: each bias is added to that token's logit before sampling (OpenAI's
    # logit_bias: -100 bans a token, +100 all but forces it)
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # None: none; n >= 0: each prompt token's logprob (given the tokens before it) plus the top-n
    # (OpenAI completions' echo with logprobs). Such a prompt is computed whole, never read from
    # the prefix cache: cached blocks have no logits.
    prompt_logprobs: int | None = None
    # "": free text; else a guide spec (``llmbus.guide.grammar.guide_spec``): the output must be JSON
    # matching its schema, between its prefix and suffix; tokens that cannot continue it are masked
    guide: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature < math.inf:  # NOTE: so written, NaN fails too
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.guide:
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with a guide: a guided output ends where its grammar does")
            check_guide(self.guide)  # GuideError is a ValueError

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024  # the sampler applies every entry at every step


def _bias_pairs(pairs) -> tuple[tuple[int, float], ...]:
    pairs = tuple(pairs)
    if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(pairs)}")
    out: dict[int, float] = {}
    for pair in pairs:
        try:
            token, bias = pair
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}") from None
        if type(token) is not int or token < 0:
            raise ValueError(f"logit_bias token ids must be integers >= 0, got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                             f"got {bias!r} for token {token}")
        if token in out:
            raise ValueError(f"logit_bias names token {token} twice")
        out[token] = float(bias)
    return tuple(out.items())
