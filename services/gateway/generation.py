"""One request's output: TokenEvents -> text pieces (detokenized, stop strings applied) -> a finish;
and a request's ``n`` choices, one Generation each, as one sequence of pieces.

Shared by the streamed and the non-streamed paths. Tokens are fed one at a time so the usage count
stops exactly at the token that completed a stop string.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from llmbus.model.detokenizer import IncrementalDetokenizer
from llmbus.protocol import LogprobEntry, TokenEvent
from llmbus.protocol.messages import INVALID_REQUEST
from services.gateway.errors import APIError, invalid, server_error
from services.gateway.shapes import TokenLogprob, Usage, token_text
from services.gateway.stop import StopStringMatcher
from services.gateway.token_stream import StreamFailure, TokenStream
from services.gateway.tools import Llama3JsonParser, ToolCallParser


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, to lead its text: ``text`` as the client sent it (or its ids
    decoded); for logprob entries, each of its tokens' name and bytes and where its text starts.
    Built once per prompt, off the event loop (a long prompt takes a while to detokenize)."""

    text: str
    ids: list[int]
    names: list[tuple[str, bytes]]  # empty without logprobs
    offsets: list[int]

    @classmethod
    def build(cls, text: str | None, ids: list[int], tokenizer, logprobs: bool) -> Echo:
        text = tokenizer.decode(ids) if text is None else text
        if not logprobs:
            return cls(text, ids, [], [])
        detok = IncrementalDetokenizer(tokenizer, [])
        names, offsets, chars = [], [], 0
        for tid in ids:
            offsets.append(min(chars + detok.start_of(tid), len(text)))
            chars += len(detok.add([tid]))
            raw = tokenizer.token_bytes(tid)
            names.append((token_text(raw), raw))
        return cls(text, ids, names, offsets)


@dataclass(frozen=True)
class Piece:
    """New text (possibly empty) and, on the last piece, the finish: a reason and usage, or an error."""

    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "tool_calls" on success
    usage: Usage | None = None
    error: APIError | None = None
    tool_calls: tuple[dict, ...] = ()  # calls completed in this piece (chat with tools)

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Generation:
    """Turns a request's token stream into pieces. ``detok.add(ids) -> str`` yields whole characters
    only and ``detok.finish()`` the rest (llmbus.model's IncrementalDetokenizer); ``token_bytes(id)``
    gives one token's bytes for logprobs (Tokenizer.token_bytes).

    A token's logprob entry goes out with its text: held while its text is (a split character, the
    start of what may be a stop string), and never sent for a token whose text lies wholly in a
    matched stop string."""

    def __init__(self, stream: TokenStream, detok, token_bytes: Callable[[int], bytes], *,
                 stops: tuple[str, ...], logprobs: bool, prompt_tokens: int, echo: Echo | None = None,
                 keep_output: bool = True, tools: ToolCallParser | Llama3JsonParser | None = None) -> None:
        self.stream = stream
        self._detok = detok
        self._token_bytes = token_bytes
        self._matcher = StopStringMatcher(stops)
        self._logprobs = logprobs
        self._chars = 0  # characters the detokenizer has made
        self._sent = 0  # characters released to the client
        self._held: list[TokenLogprob] = []
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finished = False  # the workers are done with the request (no abort needed)
        self.stopped_by_string = False  # we ended it: the workers must be told to abort
        self.failed = False  # the token stream broke (gap, silence): the workers must be told too
        self._echo = echo  # until the first event takes it
        self._base = 0  # characters of echoed prompt before the completion's text
        self._keep = keep_output  # False: max_tokens 0, the one token the workers make is dropped
        # echo with logprobs and n > 1: one choice of a prompt scores it, the others read its scores here
        self.prompt_scores: asyncio.Future | None = None
        self.scores_prompt = False  # this choice is the one that scores it
        self._tools = tools  # chat with tools: calls read out of the text

    @property
    def wants_logprobs(self) -> bool:
        return self._logprobs

    async def pieces(self) -> AsyncIterator[Piece]:
        while True:
            try:
                event = await self.stream.next()
            except StreamFailure as exc:
                self.failed = True
                yield Piece("", error=server_error(f"generation failed: {exc}", 503, code=exc.code))
                return
            if self._echo is not None and self.prompt_scores is not None:  # its first event
                if self.scores_prompt:  # its copies read the scores from here
                    if not self.prompt_scores.done():
                        self.prompt_scores.set_result(event.prompt_logprobs)
                elif event.finish_reason not in ("error", "abort"):
                    event = dataclasses.replace(event, prompt_logprobs=await self.prompt_scores)
            piece = self._consume(event)
            if self._tools is not None and piece.error is None:
                piece = self._read_calls(piece)
            yield piece
            if piece.last:
                return

    def _read_calls(self, piece: Piece) -> Piece:
        """The piece's text with tool calls taken out (held while a call may be forming); a
        finish after calls is "tool_calls", as OpenAI's."""
        text, calls = self._tools.feed(piece.text)
        reason = piece.finish_reason
        if piece.last:
            rest, more = self._tools.finish()
            text, calls = text + rest, calls + more
            if reason == "stop" and self._tools.calls:
                reason = "tool_calls"
        return dataclasses.replace(piece, text=text, tool_calls=tuple(calls), finish_reason=reason)

    def _feed(self, text: str) -> str:
        """Detokenized text through the stop matcher; what may go out now."""
        self._chars += len(text)
        out = self._matcher.feed(text)
        self._sent += len(out)
        return out

    def _release(self, everything: bool = False) -> list[TokenLogprob]:
        """The held entries whose text has started to go out (``everything``: all of them), their
        offsets counted from the start of the returned text (an echoed prompt first)."""
        n = len(self._held)
        if not everything:
            n = next((i for i, e in enumerate(self._held) if e.offset >= self._sent), n)
        out, self._held = self._held[:n], self._held[n:]
        return [dataclasses.replace(e, offset=e.offset + self._base) for e in out] if self._base else out

    def _echoed(self, event: TokenEvent) -> tuple[str, list[TokenLogprob]]:
        """The prompt's text and (with logprobs) an entry per prompt token: the first has no
        logprob; the others are the event's ``prompt_logprobs`` (none where a worker sent none)."""
        echo, self._echo = self._echo, None
        self._base = len(echo.text)
        if not self._logprobs:
            return echo.text, []
        scored = event.prompt_logprobs or []
        entries = []
        for i, ((token, raw), offset) in enumerate(zip(echo.names, echo.offsets)):
            if 0 < i <= len(scored):
                entries.append(self._entry(scored[i - 1], offset, (token, raw)))
            else:
                entries.append(TokenLogprob(token, raw, None, offset, None))
        return echo.text, entries

    def _consume(self, event: TokenEvent) -> Piece:
        self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
        text: list[str] = []
        lead: list[TokenLogprob] = []
        if self._echo is not None:
            prompt, lead = self._echoed(event)
            text.append(prompt)
        if not self._keep:  # max_tokens 0: the prompt alone
            if event.finish_reason in ("stop", "length"):
                self.finished = True
                usage = Usage(event.prompt_tokens or self.prompt_tokens, 0, self.cached_tokens)
                return Piece("".join(text), lead if self._logprobs else None, "length", usage)
            event = dataclasses.replace(event, token_ids=[], logprobs=None)
        piece = self._tokens(event, text)
        if lead:
            piece = dataclasses.replace(piece, logprobs=lead + (piece.logprobs or []))
        return piece

    def _tokens(self, event: TokenEvent, text: list[str]) -> Piece:
        for i, tid in enumerate(event.token_ids):
            self.completion_tokens += 1
            offset = self._chars + (self._detok.start_of(tid) if self._logprobs else 0)
            text.append(self._feed(self._detok.add([tid])))
            if self._logprobs and event.logprobs is not None:
                self._held.append(self._entry(event.logprobs[i], offset))
            if self._matcher.stopped:
                self.stopped_by_string = True
                return self._finish("".join(text), self._release(), "stop", event, exact=False)
        if event.finish_reason == "error":
            self.finished = True
            message = event.error or "the worker failed without a message"
            if event.error_code == INVALID_REQUEST:  # e.g. a prompt too long for the workers' cache
                return Piece("".join(text), error=invalid(message, code="invalid_request"))
            return Piece("".join(text), error=server_error(f"generation failed: {message}", 500,
                                                           code="worker_error"))
        if event.finish_reason == "abort":
            self.finished = True
            why = event.error or "deadline or shutdown"
            return Piece("".join(text), error=server_error(f"the request was aborted by the workers: {why}", 503,
                                                           code="aborted"))
        if event.finish_reason is not None:
            self.finished = True
            text.append(self._feed(self._detok.finish()))
            tail = self._matcher.flush()
            self._sent += len(tail)
            text.append(tail)
            reason = "stop" if self._matcher.stopped else event.finish_reason
            entries = self._release(everything=not self._matcher.stopped)
            return self._finish("".join(text), entries, reason, event, exact=True)
        return Piece("".join(text), self._release() if self._logprobs else None)

    def _finish(self, text: str, entries: list, reason: str, event: TokenEvent, exact: bool) -> Piece:
        if exact:  # the worker's counts are authoritative when it ended the request
            self.prompt_tokens = event.prompt_tokens or self.prompt_tokens
            self.completion_tokens = event.completion_tokens or self.completion_tokens
        usage = Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
        return Piece(text, entries if self._logprobs else None, reason, usage)

    def _named(self, token_id: int) -> tuple[str, bytes]:
        raw = self._token_bytes(token_id)
        return token_text(raw), raw

    def _entry(self, e: LogprobEntry, offset: int, named: tuple[str, bytes] | None = None) -> TokenLogprob:
        """``named``: the token's name and bytes, where already known."""
        token, raw = named or self._named(e.token_id)
        return TokenLogprob(token, raw, e.logprob, offset, tuple((*self._named(t), lp) for t, lp in e.top))


async def choice_pieces(gens: list[Generation], ended: Callable[[int], Awaitable[None]] | None = None
                        ) -> AsyncIterator[tuple[int, Piece]]:
    """The pieces of every choice, ``(index, piece)``, in the order they arrive, until each choice
    has had its last piece; ``ended(i)``, when given, is awaited once choice ``i`` has (while the
    others go on). A consumer that stops early (an error piece, a client gone) closes this
    generator, which stops the rest. Use it inside ``contextlib.aclosing``."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0].pieces()) as pieces:
            async for piece in pieces:
                yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, Piece | None]] = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async with contextlib.aclosing(gen.pieces()) as pieces:
                async for piece in pieces:
                    queue.put_nowait((i, piece))
            if ended is not None:
                await ended(i)
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(tasks)
        while live:
            i, piece = await queue.get()
            if piece is None:
                live -= 1
                if tasks[i].done() and not tasks[i].cancelled() and tasks[i].exception() is not None:
                    raise tasks[i].exception()
                continue
            yield i, piece
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
