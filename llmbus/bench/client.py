"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk.

Quirks handled: llama-server closes the connection after each stream (and may skip `[DONE]`) and
puts `usage` in the chunk that carries the last text; vLLM sends a role-only first chat chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from llmbus.bench.datasets import BenchItem
from llmbus.bench.record import RequestRecord

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class RequestConfig:
    base_url: str
    model: str
    endpoint: str = "completions"
    prompt_format: str = "text"  # completions only: "text" or "ids" (a list of ints as the prompt)
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    api_key: str | None = None
    timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)  # merged into every request body last

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.prompt_format not in ("text", "ids"):
            raise ValueError(f"prompt format must be 'text' or 'ids', got {self.prompt_format!r}")
        if self.prompt_format == "ids" and self.endpoint == "chat":
            raise ValueError("token-id prompts need --endpoint completions (chat takes messages)")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must start with http:// or https://, got {self.base_url!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.timeout_s > 0:
            raise ValueError(f"request timeout must be positive, got {self.timeout_s}")
        if not isinstance(self.extra_body, dict):
            raise ValueError(f"extra body must be a JSON object, got {self.extra_body!r}")

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        return base + ENDPOINTS[self.endpoint]

    def body(self, item: BenchItem) -> dict:
        body: dict = {"model": self.model, "max_tokens": item.output_len, "temperature": self.temperature,
                      "stream": True, "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = item.messages or [{"role": "user", "content": item.prompt}]
        else:
            body["prompt"] = item.prompt_token_ids if self.prompt_format == "ids" else item.prompt
        if self.top_p < 1:
            body["top_p"] = self.top_p
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM extra body field; llama-server reads the same name
        body.update(self.extra_body)
        return body


def _is_token_chunk(choice: dict) -> bool:
    """True when a choice carries a generated token: non-empty text, or empty text with no
    finish_reason (a token that decoded to nothing yet). A chat role-only opening delta and a
    closing chunk that carries only finish_reason are not tokens."""
    if "text" in choice:
        text = choice["text"]
    else:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or delta.get("content")
        if "role" in delta and not text:
            return False
    return bool(text) or (text == "" and choice.get("finish_reason") is None)


async def send(client: httpx.AsyncClient, cfg: RequestConfig, item: BenchItem, rec: RequestRecord) -> None:
    """Fill `rec` in place; never raises for server or connection failures (they become errors)."""
    rec.prompt_len, rec.requested_output_len = item.prompt_len, item.output_len
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    t0 = time.perf_counter()
    last = None
    chunks = 0
    finished = False
    usages: dict[int | None, dict] = {}  # the latest usage by the choice its chunk carried (None: none)
    try:
        async with client.stream("POST", cfg.url, json=cfg.body(item), headers=headers, timeout=cfg.timeout_s) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.error = _error_message(body) or resp.reason_phrase
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    finished = True
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if not isinstance(data, dict):
                    raise ValueError(f"stream event is not a JSON object: {payload[:80]!r}")
                if "error" in data:
                    rec.error = _error_message(payload) or "error event in stream"
                    return
                choices = data.get("choices") or []
                if choices and _is_token_chunk(choices[0]):
                    chunks += 1
                    if last is None:
                        rec.ttft_s = now - t0
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                if choices and choices[0].get("finish_reason") is not None:
                    finished = True
                usage = data.get("usage")
                if usage:
                    usages[choices[0].get("index") if choices else None] = usage
    except (httpx.HTTPError, OSError, ValueError, TypeError, AttributeError) as exc:  # JSON errors are ValueErrors
        # NOTE: a server that closes the connection once it has sent the last token and usage
        # (llama-server) completed the request; anything cut earlier is an error.
        if not (finished or rec.usage_reported):
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
            return
    _read_usage(rec, usages)
    if last is None:
        rec.error = "stream ended without any token"
        return
    if not (finished or rec.usage_reported):
        rec.error = "stream ended before finish_reason, usage or [DONE]"
        return
    rec.e2e_s = last - t0
    if not rec.usage_reported:
        rec.output_tokens = chunks  # fallback, flagged by usage_reported=False; never re-tokenized
    rec.success = True


def _read_usage(rec: RequestRecord, usages: dict[int | None, dict]) -> None:
    """The request's usage from its stream's: one chunk with empty choices is the whole request's
    (OpenAI, vLLM, llmbus); usage riding on a choice's chunks (llama-server) is that choice's, the
    last one each, and a request with ``n`` choices sums them."""
    if not usages:
        return
    parts = [usages[None]] if None in usages else list(usages.values())
    rec.usage_reported = True
    rec.output_tokens = sum(int(u.get("completion_tokens") or 0) for u in parts)
    rec.prompt_tokens = int(parts[0].get("prompt_tokens") or 0)
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in parts]
    if all(c is not None for c in cached):
        rec.cached_tokens = min(int(c) for c in cached)


def _error_message(body: str) -> str:
    try:
        err = json.loads(body).get("error")
    except (json.JSONDecodeError, AttributeError):
        return body.strip()[:300]
    if isinstance(err, dict):
        return str(err.get("message", err))[:300]
    return str(err)[:300] if err else body.strip()[:300]
