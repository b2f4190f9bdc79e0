"""Serving one completion or chat request: prepare it, submit it to the bus, and answer with SSE
or one JSON body. The per-request abort context covers everything after the submit."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import orjson
from starlette.requests import Request
from starlette.responses import Response

from services.gateway.aborts import abort_unless_finished, release_ended
from llmbus import tracing
from llmbus.model.tokenizer import IncrementalDetokenizer
from llmbus.protocol import GenerateRequest
from services.gateway.bus_client import GatewayBus, Listening
from services.gateway.config import GatewayConfig
from services.gateway.errors import APIError
from services.gateway.generation import Generation, Piece, choice_pieces
from services.gateway.limits import Admission, RateLimiter, TenantLimits, effective_priority
from services.gateway.metrics import GatewayMetrics
from services.gateway.models import ModelRegistry
from services.gateway.openai_request import OpenAIRequest, service_tier
from services.gateway.prepare import prepare
from services.gateway.responses import ResponsesCall, ResponseShapes, events
from services.gateway.shapes import Shapes, TokenLogprob, Usage
from services.gateway.stored import ResponseStore
from services.gateway.sse import SSEResponse, chunks
from services.gateway.tenants import Tenants
from services.gateway.token_stream import TokenStream
from services.gateway.tools import forced_call_guide, make_parser


# new tokens a choice reserves of its tenant's token limits when the client set no max_tokens (its
# limit is then the rest of the context, which would take a whole bucket); its usage is charged at
# its end, and a longer answer leaves the bucket in debt
UNSET_RESERVE = 256


@dataclass
class Gateway:
    """What every handler needs: passed in, never global."""

    config: GatewayConfig
    models: ModelRegistry
    bus: GatewayBus | None = None  # set once the NATS connection is up
    metrics: GatewayMetrics = dataclasses.field(default_factory=GatewayMetrics)
    tenants: Tenants | None = None  # --api-keys-file: keys -> tenants; None: open, one shared cache
    responses: ResponseStore = dataclasses.field(default_factory=ResponseStore)  # stored Responses answers
    limits: TenantLimits | None = None  # --tenant-limits; None: no limits
    limiter: RateLimiter | None = dataclasses.field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.limits is not None:
            self.limiter = RateLimiter(self.limits, on_limited=lambda t, limit: self.metrics.limited.add(1, t, limit))

    def tenant(self, http: Request) -> str:
        """The caller's tenant ("" on an open gateway); APIError 401 for a missing or wrong key."""
        return "" if self.tenants is None else self.tenants.tenant(http.headers.get("authorization"))


async def serve(gw: Gateway, http: Request, req: OpenAIRequest, tenant: str = "", responses: ResponsesCall | None = None):
    """``tenant`` salts the prefix caches: tenants never share cached blocks. With tracing on the
    request's span starts here (continuing the client's ``traceparent``) and ends with its answer.
    ``responses``: the request came to /v1/responses (what its response echoes back, how it is
    stored): the answer is a ``response`` object or Responses events (``services.gateway.responses``)."""
    arrival = time.monotonic()
    operation = "chat" if req.kind == "chat" else "text_completion"
    span = tracing.start(f"{operation} {req.model}", http.headers.get("traceparent", ""), root=True,
                         kind=tracing.SpanKind.SERVER, attributes={
                             "gen_ai.operation.name": operation, "gen_ai.request.model": req.model,
                             "llmbus.n": req.n, "llmbus.stream": req.stream})  # fmt: skip
    try:
        return await _serve(gw, http, req, tenant, arrival, span, responses)
    except BaseException as exc:  # refused, or failed, before its pieces ended the span
        if span.is_recording():
            tracing.fail(span, exc.message if isinstance(exc, APIError) else repr(exc))
            if isinstance(exc, APIError):
                span.set_attribute("http.response.status_code", exc.status)
            span.end()
        raise


async def _serve(gw: Gateway, http: Request, req: OpenAIRequest, tenant: str, arrival: float, span,
                 responses: ResponsesCall | None):
    model = gw.models.get(req.model)
    if req.tools and gw.config.tool_parser is None:
        raise APIError(400, "This server reads no tool calls: start the gateway with --tool-parser (e.g. hermes) "
                       "for a model trained to call tools.", param="tools", code="unsupported_parameter")
    if req.forced_tools:  # the answer is one call: decoding guided to the parser's format
        guide = forced_call_guide(req.tools, req.forced_tools, gw.config.tool_parser)
        req = dataclasses.replace(req, sampling={**req.sampling, "guide": guide})
    if gw.limiter is not None:  # a tenant with no room is refused before its prompt is tokenized
        gw.limiter.precheck(tenant)
    # NOTE: rendering and tokenizing a large prompt takes a while: keep it off the event loop
    priority = effective_priority(req.priority, None if gw.limits is None else gw.limits.priority_of(tenant))
    prepared = await asyncio.to_thread(prepare, req, model, gw.config.request_timeout_s, tenant, priority)
    if gw.bus is None:
        raise APIError(503, "the gateway is not connected to the bus yet", type="server_error",
                       code="service_unavailable")
    admission = None
    if gw.limiter is not None:  # NOTE: after tokenizing: the tokens a request reserves are its prompt's
        new = [r.sampling.max_tokens if req.max_tokens is not None else min(r.sampling.max_tokens, UNSET_RESERVE)
               for r in prepared.requests]  # fmt: skip
        where = "input" if responses else "messages" if req.kind == "chat" else "prompt"
        admission = gw.limiter.admit(tenant, sum(len(r.prompt_token_ids) for r in prepared.requests), sum(new) * req.n,
                                     where)  # fmt: skip
    try:
        return await _answer(gw, http, req, model, prepared, span, arrival, admission, responses)
    except BaseException:
        if admission is not None:  # failed before its answer began: nothing served, nothing charged
            admission.settle(0)
        raise


async def _answer(gw: Gateway, http: Request, req: OpenAIRequest, model, prepared, span, arrival: float,
                  admission: Admission | None, responses: ResponsesCall | None):
    bus = gw.bus
    tok = model.tokenizer
    requests = choice_requests(prepared.requests, req.n)
    if parent := tracing.traceparent(span):  # every service's span of it is a child of this one
        requests = [dataclasses.replace(r, traceparent=parent) for r in requests]
        span.set_attributes({"llmbus.request_id": requests[0].request_id,
                             "gen_ai.usage.input_tokens": sum(len(r.prompt_token_ids) for r in prepared.requests)})
    echoes = [echo for echo in prepared.echoes for _ in range(req.n)]
    tool_names = tuple(t["function"]["name"] for t in req.tools or ())
    choices = [_Choice(r.request_id, Generation(
        TokenStream(r.request_id, gw.config.token_timeout_s, busy=lambda worker: bus.workers_busy(model.name, worker),
                    deadline=r.deadline),
        IncrementalDetokenizer(tok, r.prompt_token_ids), tok.token_bytes, stops=req.stop,
        logprobs=req.logprobs is not None, prompt_tokens=len(r.prompt_token_ids),
        echo=echo, keep_output=req.max_tokens != 0, tools=make_parser(gw.config.tool_parser, tool_names) if req.tools else None))
        for r, echo in zip(requests, echoes)]
    if req.echo and req.logprobs is not None and req.n > 1:  # choice i * n scores prompt i for its copies
        loop = asyncio.get_running_loop()
        for i in range(0, len(choices), req.n):
            scores = loop.create_future()
            for c in choices[i : i + req.n]:
                c.gen.prompt_scores = scores
            choices[i].gen.scores_prompt = True
    for c, sub in zip(choices, await _submit_all(bus, requests, [c.gen.stream for c in choices])):
        c.sub = sub
    tier = service_tier(prepared.requests[0].priority)
    shapes = Shapes(req.kind, prepared.requests[0].request_id, model.name, prepared.created, tier)
    gens = [c.gen for c in choices]

    @contextlib.asynccontextmanager
    async def guard():
        try:
            async with _guard(bus, choices):
                yield
        finally:
            observer.close()  # a stream cancelled before its first piece was read ends here, cancelled
            if admission is not None:  # the answer is over: if its pieces did not settle it, keep the reservation
                admission.settle(None)

    async def ended(i: int) -> None:  # one choice done while others go on
        await release_ended(bus, choices[i].request_id, choices[i].sub, choices[i].gen)

    def pieces():  # every choice's, observed for /metrics
        return observer.watch(choice_pieces(gens, ended), len(gens))

    def settle(outcome: str, usage: Usage | None) -> None:
        """Charge the tenant what the request used; nothing when it failed (the client got an error);
        the reservation when the client left (usage unknown)."""
        if admission is not None:
            if usage is not None:
                admission.settle(usage.prompt_tokens + usage.completion_tokens)
            elif outcome == "error":
                admission.settle(0)

    headers = admission.headers if admission is not None else None  # the tenant's x-ratelimit-*
    observer = gw.metrics.request(model.name, req.n, arrival, span, settle, prepared.requests[0].tenant)
    answer = None if responses is None else ResponseShapes(model.name, {**responses.echo, "service_tier": tier},
                                                           prepared.created, responses.keep)  # fmt: skip
    if req.stream:
        body = events(pieces, answer) if answer else chunks(pieces, len(gens), shapes, req.include_usage, req.n)
        return SSEResponse(body, guard, headers)
    async with guard():
        body = await _until_disconnect(http, _collect(pieces, gens, shapes, req.n))
    if body is None:  # the client hung up; the guard has published the aborts
        return Response(status_code=499)
    if answer is not None:
        body = await answer.finish(answer.from_chat(body))
    return Response(orjson.dumps(body), media_type="application/json", headers=headers)


async def _submit_all(bus: GatewayBus, requests: list[GenerateRequest], streams: list[TokenStream]) -> list[Listening]:
    """Enqueue every choice at once (each publish waits for JetStream's ack), so they reach the
    workers together. If one is refused, or the handler is cancelled meanwhile, none stays: the
    others are cancelled, their streams closed and every choice aborted, then the error raised."""
    tasks = [asyncio.ensure_future(bus.submit(r, s)) for r, s in zip(requests, streams)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await asyncio.shield(_withdraw(bus, requests, tasks))
        raise


async def _withdraw(bus: GatewayBus, requests: list[GenerateRequest], tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, Listening):
            result.close()
    for r in requests:
        with contextlib.suppress(Exception):
            await bus.abort(r.request_id, "submit_failed")


def choice_requests(prompts: list[GenerateRequest], n: int) -> list[GenerateRequest]:
    """The bus requests of a request's choices, ``n`` per prompt (one prompt but for a completions
    batch), in choice order: choice ``i`` answers prompt ``i // n``. One choice is the request
    itself; more are copies with ids ``<id>-<i>`` and, where it is seeded, seeds ``seed + i``
    (wrapped to 64 bits), so each choice draws its own tokens and a seeded request still repeats
    exactly. A prompt's copies reach the workers together, and the engine prefills it once (the
    first computes its blocks, the others read them); only the first scores it (echo with logprobs),
    which would keep the others from the cache."""
    if len(prompts) * n == 1:
        return list(prompts)
    out = []
    for i in range(len(prompts) * n):
        request = prompts[i // n]
        seed = request.sampling.seed
        sampling = request.sampling if seed is None else dataclasses.replace(
            request.sampling, seed=(seed + i + 2**63) % 2**64 - 2**63)
        if i % n:  # the prompt's first choice scores it (echo); the copies read its blocks from the cache
            sampling = dataclasses.replace(sampling, prompt_logprobs=None)
        out.append(dataclasses.replace(request, request_id=f"{request.request_id}-{i}", sampling=sampling))
    return out


@dataclass
class _Choice:
    request_id: str  # its bus request
    gen: Generation
    sub: Listening | None = None  # once submitted


@contextlib.asynccontextmanager
async def _guard(bus: GatewayBus, choices: list[_Choice]) -> AsyncIterator[None]:
    """Every choice's abort context (``abort_unless_finished``) at once."""
    async with contextlib.AsyncExitStack() as stack:
        for c in choices:
            await stack.enter_async_context(abort_unless_finished(bus, c.request_id, c.sub, c.gen))
        yield


async def _collect(pieces: Callable[[], AsyncIterator[tuple[int, Piece]]], gens: list[Generation], shapes: Shapes,
                   n: int) -> dict:
    texts: list[list[str]] = [[] for _ in gens]
    calls: list[list[dict]] = [[] for _ in gens]
    logprobs: list[list[TokenLogprob] | None] = [[] if g.wants_logprobs else None for g in gens]
    ends: dict[int, tuple[str, Usage]] = {}
    async with contextlib.aclosing(pieces()) as stream:
        async for i, piece in stream:
            if piece.error is not None:
                raise piece.error
            texts[i].append(piece.text)
            calls[i].extend(piece.tool_calls)
            if logprobs[i] is not None and piece.logprobs:
                logprobs[i].extend(piece.logprobs)
            if piece.finish_reason is not None:
                ends[i] = (piece.finish_reason, piece.usage)
    if len(ends) < len(gens):
        raise APIError(500, "the token stream ended without a finish", type="server_error", code="internal_error")
    choices = [shapes.choice(i, "".join(texts[i]), ends[i][0], logprobs[i], calls[i]) for i in range(len(gens))]
    return shapes.response(choices, Usage.of_choices([ends[i][1] for i in range(len(gens))], n))


async def _until_disconnect(http: Request, coro) -> dict | None:
    """Run ``coro``; if the client disconnects first, cancel it and return None."""
    work = asyncio.ensure_future(coro)

    async def hung_up() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (listener, work):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    return None if work.cancelled() else work.result()
