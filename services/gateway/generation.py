"""One request's output: TokenEvents -> text pieces (detokenized, stop strings applied) -> a finish.

Shared by the streamed and the non-streamed paths. Tokens are fed one at a time so the usage count
stops exactly at the token that completed a stop string.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from llmbus.protocol import LogprobEntry, TokenEvent
from services.gateway.errors import APIError, server_error
from services.gateway.shapes import TokenLogprob, Usage
from services.gateway.stop import StopStringMatcher
from services.gateway.token_stream import StreamFailure, TokenStream


@dataclass(frozen=True)
class Piece:
    """New text (possibly empty) and, on the last piece, the finish: a reason and usage, or an error."""

    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" on success
    usage: Usage | None = None
    error: APIError | None = None

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Generation:
    """Turns a request's token stream into pieces. ``detok.add(ids) -> str`` yields whole characters
    only and ``detok.finish()`` the rest (llmbus.model's IncrementalDetokenizer); ``token_text(id)``
    names one token for logprobs."""

    def __init__(self, stream: TokenStream, detok, token_text: Callable[[int], str], *,
                 stops: tuple[str, ...], logprobs: bool, prompt_tokens: int) -> None:
        self._stream = stream
        self._detok = detok
        self._token_text = token_text
        self._matcher = StopStringMatcher(stops)
        self._logprobs = logprobs
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finished = False  # the workers are done with the request (no abort needed)
        self.stopped_by_string = False  # we ended it: the workers must be told to abort
        self.failed = False  # the token stream broke (gap, silence): the workers must be told too

    @property
    def wants_logprobs(self) -> bool:
        return self._logprobs

    async def pieces(self) -> AsyncIterator[Piece]:
        while True:
            try:
                event = await self._stream.next()
            except StreamFailure as exc:
                self.failed = True
                yield Piece("", error=server_error(f"generation failed: {exc}", 503, code=exc.code))
                return
            piece = self._consume(event)
            yield piece
            if piece.last:
                return

    def _consume(self, event: TokenEvent) -> Piece:
        self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
        text, entries = [], []
        for i, tid in enumerate(event.token_ids):
            self.completion_tokens += 1
            text.append(self._matcher.feed(self._detok.add([tid])))
            if self._logprobs and event.logprobs is not None:
                entries.append(self._entry(event.logprobs[i]))
            if self._matcher.stopped:
                self.stopped_by_string = True
                return self._finish("".join(text), entries, "stop", event, exact=False)
        if event.finish_reason == "error":
            self.finished = True
            message = event.error or "the worker failed without a message"
            return Piece("".join(text), error=server_error(f"generation failed: {message}", 500,
                                                           code="worker_error"))
        if event.finish_reason == "abort":
            self.finished = True
            return Piece("".join(text), error=server_error(
                "the request was aborted by the workers (deadline or shutdown)", 503, code="aborted"))
        if event.finish_reason is not None:
            self.finished = True
            text.append(self._matcher.feed(self._detok.finish()))
            text.append(self._matcher.flush())
            reason = "stop" if self._matcher.stopped else event.finish_reason
            return self._finish("".join(text), entries, reason, event, exact=True)
        return Piece("".join(text), entries if self._logprobs else None)

    def _finish(self, text: str, entries: list, reason: str, event: TokenEvent, exact: bool) -> Piece:
        if exact:  # the worker's counts are authoritative when it ended the request
            self.prompt_tokens = event.prompt_tokens or self.prompt_tokens
            self.completion_tokens = event.completion_tokens or self.completion_tokens
        usage = Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
        return Piece(text, entries if self._logprobs else None, reason, usage)

    def _entry(self, e: LogprobEntry) -> TokenLogprob:
        return TokenLogprob(self._token_text(e.token_id), e.logprob,
                            tuple((self._token_text(t), lp) for t, lp in e.top))
