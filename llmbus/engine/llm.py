"""Offline Python API: ``LLM(model_dir).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from llmbus.engine.config import EngineConfig
from llmbus.engine.engine import Engine, StepOutput
from llmbus.engine.sampling_params import SamplingParams
from llmbus.engine.sequence import TokenLogprob


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprob] | None = None  # entry i scores prompt token i + 1
    error: str = ""  # finish_reason "error": why (the engine failed on this request alone)


class LLM:
    def __init__(self, model_dir: str, **engine_options) -> None:
        """``engine_options`` are the fields of ``EngineConfig`` (dtype, block_size, num_blocks, ...)."""
        self.engine = Engine.from_model_dir(str(model_dir), EngineConfig(**engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer.json: give prompts as token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("a prompt must be a string or a list of token ids")
        return list(prompt)

    def generate(
        self,
        prompts: list[str | list[int]] | str,
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        encoded = [self.encode(p) for p in prompts]
        engine = self.engine
        for ids in encoded:  # validate everything before anything is queued
            engine.check_prompt(ids)
        order: list[str] = []
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprob]] = {}
        finished: dict[str, StepOutput] = {}
        prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        for ids, p in zip(encoded, params):
            rid = f"offline-{next(self._ids)}"
            engine.add_request(rid, ids, p)
            order.append(rid)
            tokens[rid] = []
            logprobs[rid] = []
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    tokens[out.request_id].extend(out.new_token_ids)
                    if out.logprobs:
                        logprobs[out.request_id].extend(out.logprobs)
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[out.request_id] = out.prompt_logprobs
                    if out.finish_reason is not None:
                        finished[out.request_id] = out
        except BaseException:
            for rid in order:
                engine.abort(rid)
            raise
        results = []
        for rid, ids, p in zip(order, encoded, params):
            end = finished.get(rid)
            results.append(
                RequestOutput(
                    request_id=rid,
                    prompt_token_ids=ids,
                    token_ids=tokens[rid],
                    text=self.tokenizer.decode(tokens[rid]) if self.tokenizer is not None else "",
                    finish_reason=end.finish_reason if end else "abort",
                    logprobs=logprobs[rid] if p.logprobs is not None else None,
                    num_cached_tokens=end.num_cached_tokens if end else 0,
                    prompt_logprobs=prompt_logprobs.get(rid),
                    error=end.error if end else "",
                )
            )
        return results
