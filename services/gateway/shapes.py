"""OpenAI response bodies and stream chunks, for completions and chat, in their exact shapes."""

from __future__ import annotations

from dataclasses import dataclass


def token_text(raw: bytes) -> str:
    """A token's name in logprobs: its bytes as text, or where they split a character (a byte-level
    token, a byte-fallback one), OpenAI's spelling of them, ``bytes:\\xf0\\x9f``. The entry's
    ``bytes`` carries them exactly either way."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob entry, already turned into text: ``raw`` its bytes, ``offset``
    the characters of the completion's text before it."""

    token: str
    raw: bytes
    logprob: float | None  # None: an echoed prompt's first token (nothing before it to predict it)
    offset: int
    top: tuple[tuple[str, bytes, float], ...] | None  # most likely first


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @staticmethod
    def of_choices(usages: list[Usage], n: int = 1) -> Usage:
        """A request's usage from its choices', ``n`` consecutive ones per prompt: each prompt
        counted once, the completions summed. Cached tokens: per prompt, those every one of its
        choices found cached, so a prompt that the first choice computed and the others then read
        counts as computed, as it was for this request."""
        groups = [usages[i : i + n] for i in range(0, len(usages), n)]
        return Usage(sum(g[0].prompt_tokens for g in groups), sum(u.completion_tokens for u in usages),
                     sum(min(u.cached_tokens for u in g) for g in groups))

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class Shapes:
    """Builds the bodies of one response; ``kind`` is "completion" or "chat"."""

    def __init__(self, kind: str, request_id: str, model: str, created: int, service_tier: str = "default") -> None:
        if kind not in ("completion", "chat"):
            raise ValueError(f"kind must be 'completion' or 'chat', got {kind!r}")
        self.kind, self.request_id, self.model, self.created = kind, request_id, model, created
        self.service_tier = service_tier  # as OpenAI reports it: the tier the request ran in

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "service_tier": self.service_tier}

    def chunk(self, text: str | None, finish_reason: str | None, logprobs: list[TokenLogprob] | None,
              *, first: bool = False, include_usage: bool = False, index: int = 0,
              tool_calls: list[tuple[int, dict]] = ()) -> dict:
        """A stream chunk of choice ``index``. For chat, ``first`` adds delta.role; ``text=None``
        gives an empty delta; ``tool_calls``: (the call's index in its choice, the call)."""
        if self.kind == "chat":
            delta: dict = {"role": "assistant", "content": text or ""} if first else {}
            if not first and text is not None and (text or not tool_calls):
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": k, **call} for k, call in tool_calls]
            choice = {"index": index, "delta": delta, "logprobs": self._logprobs(logprobs),
                      "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text or "", "logprobs": self._logprobs(logprobs),
                      "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = []
        body["usage"] = usage.body()
        return body

    def choice(self, index: int, text: str, finish_reason: str, logprobs: list[TokenLogprob] | None,
               tool_calls: list[dict] = ()) -> dict:
        """One choice of the non-streamed response."""
        if self.kind == "chat":
            message: dict = {"role": "assistant", "content": text}
            if tool_calls:  # the text around the calls, if any, stays content
                message = {"role": "assistant", "content": text.strip() or None, "tool_calls": list(tool_calls)}
            return {"index": index, "message": message, "logprobs": self._logprobs(logprobs),
                    "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}

    def response(self, choices: list[dict], usage: Usage) -> dict:
        """The whole non-streamed response: ``choices`` from ``choice``, in index order."""
        body = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        body["choices"] = choices
        body["usage"] = usage.body()
        return body

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        if self.kind == "chat":
            return {"content": [_chat_entry(e) for e in entries], "refusal": None}
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [_top_dict(e) for e in entries], "text_offset": [e.offset for e in entries]}


def _chat_entry(e: TokenLogprob) -> dict:
    return {"token": e.token, "logprob": e.logprob, "bytes": list(e.raw),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(raw)} for t, raw, lp in e.top]}


def _top_dict(e: TokenLogprob) -> dict[str, float] | None:
    """Completions' ``{token: logprob}``. NOTE: two tokens can share a name (an added token and the
    text it spells): the likelier keeps it. None for an echoed prompt's first token."""
    if e.top is None:
        return None
    top: dict[str, float] = {}
    for t, _, lp in e.top:
        top.setdefault(t, lp)
    return top
