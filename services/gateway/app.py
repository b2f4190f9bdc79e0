"""The Starlette application: routes, JSON body reading with a size limit, OpenAI-format errors for
everything (including 404, 405, 413 and unexpected failures)."""

from __future__ import annotations

import contextlib
import logging

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from services.gateway.errors import APIError, invalid, wrong_type
from services.gateway.handlers import Gateway, serve
from services.gateway.openai_request import parse_chat, parse_completion
from services.gateway.responses import ResponsesCall, answer_turn, parse_responses

log = logging.getLogger("llmbus.gateway")


def build_app(gw: Gateway) -> Starlette:
    async def health(request: Request) -> Response:
        if gw.bus is None or not gw.bus.nc.is_connected:
            return _json({"status": "unavailable", "bus": "disconnected"}, 503)
        return _json({"status": "ok"})

    async def models(request: Request) -> Response:
        gw.tenant(request)
        return _json(gw.models.listing())

    async def model(request: Request) -> Response:
        gw.tenant(request)
        return _json(gw.models.get(request.path_params["model"]).card())

    async def completions(request: Request):
        async with counted("completions") as answer:
            tenant = gw.tenant(request)
            body = await read_json(request, gw.config.max_body_bytes)
            return answer(await serve(gw, request, parse_completion(body, gw.config.max_stop_strings), tenant))

    async def chat(request: Request):
        async with counted("chat") as answer:
            tenant = gw.tenant(request)
            body = await read_json(request, gw.config.max_body_bytes)
            return answer(await serve(gw, request, parse_chat(body, gw.config.max_stop_strings), tenant))

    async def responses(request: Request):
        async with counted("responses") as answer:
            tenant = gw.tenant(request)
            body = await read_json(request, gw.config.max_body_bytes)
            previous = body.get("previous_response_id") if isinstance(body, dict) else None
            if previous is not None and not isinstance(previous, str):
                raise wrong_type("previous_response_id", "a string", previous)
            history = (await gw.responses.load(previous, tenant, "previous_response_id"))["messages"] if previous else []
            req, echo, conversation = parse_responses(body, gw.config.max_stop_strings, history)

            async def keep(response: dict) -> bool:
                try:
                    turn = answer_turn(response)
                except APIError as exc:  # NOTE: an answer that cannot be continued: told unstored, not failed
                    log.warning("response %s not stored: %s", response["id"], exc.message)
                    return False
                return await gw.responses.save(response, conversation + turn, tenant)

            call = ResponsesCall(echo, keep if echo["store"] and gw.responses.on else None)
            return answer(await serve(gw, request, req, tenant, responses=call))

    async def stored_response(request: Request) -> Response:
        tenant = gw.tenant(request)
        rid = request.path_params["response_id"]
        if request.method == "DELETE":
            await gw.responses.delete(rid, tenant)
            return _json({"id": rid, "object": "response", "deleted": True})
        return _json((await gw.responses.load(rid, tenant))["response"])

    @contextlib.asynccontextmanager
    async def counted(endpoint: str):
        """Counts the endpoint's answer by status: the response's, an APIError's, or 500."""
        status = [500]

        def answer(response):
            status[0] = getattr(response, "status_code", 200)  # a stream starts 200
            return response

        try:
            yield answer
        except APIError as exc:
            status[0] = exc.status
            raise
        finally:
            gw.metrics.http.add(1, endpoint, str(status[0]))

    async def metrics(request: Request) -> Response:
        instances = await gw.bus.instances() if gw.bus is not None else []
        services = await gw.bus.scrape(instances) if gw.bus is not None else []
        return Response(gw.metrics.render(instances, services), media_type="text/plain; version=0.0.4; charset=utf-8")

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),  # names may hold "/" (org/name)
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
    ]
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _unexpected}
    return Starlette(routes=routes, exception_handlers=handlers)


async def read_json(request: Request, limit: int):
    """The body parsed as JSON; 413 past ``limit`` bytes (checked while reading), 400 if malformed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    data = bytearray()
    try:
        async for part in request.stream():
            data += part
            if len(data) > limit:
                raise _too_large(limit)
    except ClientDisconnect:  # gone mid-body: nobody reads the answer, and nothing failed here
        log.debug("client disconnected while sending %s %s", request.method, request.url.path)
        raise APIError(400, "The client disconnected before sending the whole request body.",
                       code="client_disconnected") from None
    if not data:
        raise invalid("The request body is empty; send a JSON object.", None, code="invalid_json")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"We could not parse the JSON body of your request: {exc}", None,
                      code="invalid_json") from None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {limit} bytes.",
                    code="request_too_large")


def _json(body: dict, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        error = APIError(404, f"Invalid URL ({request.method} {request.url.path})", code="not_found")
    elif exc.status_code == 405:
        error = APIError(405, f"Method {request.method} is not allowed on {request.url.path}",
                         code="method_not_allowed")
    else:
        error = APIError(exc.status_code, str(exc.detail), code=None)
    response = error.response()
    for key, value in (exc.headers or {}).items():
        response.headers[key] = value
    return response


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error serving %s %s", request.method, request.url.path)
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error",
                    code="internal_error").response()
