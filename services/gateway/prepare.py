"""From a parsed OpenAI request to a GenerateRequest: render, tokenize, check the context length,
resolve max_tokens, validate the sampling values."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from llmbus.engine.sampling_params import SamplingParams
from llmbus.protocol import GenerateRequest, SamplingSpec
from services.gateway.errors import APIError, invalid
from services.gateway.generation import Echo
from services.gateway.models import ServedModel
from services.gateway.openai_request import OpenAIRequest


@dataclass(frozen=True)
class Prepared:
    requests: list[GenerateRequest]  # one per prompt (a completions batch has several), one id for all
    echoes: list[Echo | None]  # per prompt, with echo: what leads its choices' text
    created: int  # unix seconds, the "created" field of every response body


def prepare(req: OpenAIRequest, model: ServedModel, request_timeout_s: float, tenant: str = "",
            priority: int = 0) -> Prepared:  # fmt: skip
    """``tenant`` ("" on an open gateway) names the caller and salts its prefix caches; ``priority``
    is what its requests run at (``effective_priority``)."""
    now = time.time()
    request_id = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    prompts: list[str | tuple[int, ...] | None] = [None] if req.kind == "chat" else list(req.prompt)
    requests = []
    for i, prompt in enumerate(prompts):
        where = "messages" if req.kind == "chat" else "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        prompt_ids = _prompt_ids(req, prompt, model, where)
        if req.echo and req.logprobs is not None:
            _check_scored_length(len(prompt_ids), req.logprobs, where)
        spec = _sampling(req, _max_tokens(req, len(prompt_ids), model.max_model_len, where), model)
        requests.append(GenerateRequest(request_id=request_id, model=model.name, prompt_token_ids=prompt_ids,
                                        sampling=spec, deadline=now + request_timeout_s, created=now,
                                        tenant=tenant, cache_salt=tenant, priority=priority))  # fmt: skip
    echoes = [Echo.build(p if isinstance(p, str) else None, r.prompt_token_ids, model.tokenizer, req.logprobs is not None)
              if req.echo else None for p, r in zip(prompts, requests)]
    return Prepared(requests, echoes, int(now))


# NOTE: a prompt's logprobs travel in one token event, which must fit a NATS message (1 MiB by
# default): an entry is ~40 bytes plus ~16 per alternative
SCORED_BYTES = 1 << 20


def _check_scored_length(n: int, top: int, where: str) -> None:
    most = SCORED_BYTES // (40 + 16 * top)
    if n > most:
        raise invalid(f"echo with logprobs={top} scores prompts of at most {most} tokens; this one has {n}. "
                      "Ask for fewer logprobs or send a shorter prompt.", where)


def _max_tokens(req: OpenAIRequest, n: int, limit: int, where: str) -> int:
    """The completion's token limit for an ``n``-token prompt, checked against the context."""
    if n >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens, but the prompt has "
                       f"{n} tokens, leaving no room for output. Shorten the prompt.",
                       param=where, code="context_length_exceeded")
    max_tokens = req.max_tokens if req.max_tokens is not None else limit - n
    # NOTE: max_tokens 0 (echo: score the prompt) asks the workers for one token, which is dropped
    max_tokens = max(max_tokens, 1)
    if n + max_tokens > limit:
        name = req.max_tokens_param
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                       f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
                       f"Reduce the prompt or '{name}'.", param=name, code="context_length_exceeded")
    return max_tokens


def _prompt_ids(req: OpenAIRequest, prompt: str | tuple[int, ...] | None, model: ServedModel, where: str) -> list[int]:
    tok = model.tokenizer
    if req.kind == "chat":
        try:
            extra = {"tools": list(req.tools)} if req.tools else {}
            text = tok.apply_chat_template(list(req.messages), add_generation_prompt=True, **extra)
        except ValueError as exc:
            raise invalid(f"The messages cannot be rendered with this model's chat template: {exc}",
                          "messages") from None
        ids = _encode(tok, text, False, model.max_model_len, where)
    elif isinstance(prompt, str):
        ids = _encode(tok, prompt, True, model.max_model_len, where)
    else:
        vocab = model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise invalid(f"'{where}' has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", where)
        ids = list(prompt)
    if not ids:
        raise invalid("The prompt is empty after tokenization.", where)
    return list(ids)


# NOTE: a text of more than HEAD_CHARS_PER_TOKEN characters a context token is judged by its head
# first. Tokenizing all of it only to refuse it takes seconds a megabyte, and a few such requests
# would tie up the gateway's threads and cores. A head that alone is over twice the context (BPE over
# the longer text cannot merge more than half of that away) proves the whole cannot fit.
HEAD_CHARS_PER_TOKEN = 16


def _encode(tok, text: str, add_special_tokens: bool, limit: int, where: str) -> list[int]:
    head_chars = HEAD_CHARS_PER_TOKEN * limit
    if len(text) > head_chars:
        head = len(tok.encode(text[:head_chars], add_special_tokens=add_special_tokens))
        if head > 2 * limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but the prompt has "
                           f"more: its first {head_chars} characters alone are {head} tokens. Shorten the prompt.",
                           param=where, code="context_length_exceeded")  # fmt: skip
    return tok.encode(text, add_special_tokens=add_special_tokens)


def _sampling(req: OpenAIRequest, max_tokens: int, model: ServedModel) -> SamplingSpec:
    s = req.sampling
    vocab = model.config.vocab_size
    for name, ids in (("stop_token_ids", s["stop_token_ids"]), ("logit_bias", [t for t, _ in s["logit_bias"]])):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise invalid(f"'{name}' has ids outside the vocabulary [0, {vocab}): {bad[:5]}", name)
    kwargs = dict(s, max_tokens=max_tokens, logprobs=req.logprobs, stop_token_ids=list(s["stop_token_ids"]),
                  prompt_logprobs=req.logprobs if req.echo else None)
    try:  # the engine's own validation, so a request the workers would refuse fails here, clearly
        SamplingParams(**{**kwargs, "stop_token_ids": tuple(kwargs["stop_token_ids"])})
    except ValueError as exc:  # (named where the engine's message names one field: ignore_eos with a guide)
        param = "ignore_eos" if str(exc).startswith("ignore_eos") else None
        raise invalid(f"Invalid sampling parameters: {exc}", param) from None
    return SamplingSpec(**kwargs)
