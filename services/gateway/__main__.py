"""``python -m services.gateway --nats-url URL --model NAME=DIR [--model ...] --host H --port P``.

Loads every model's tokenizer and config, then runs in the service skeleton (llmbus.bus.service:
streams ensured, registry heartbeat, drain on exit). Once uvicorn accepts connections it prints
``llmbus gateway listening http://H:P`` and then the skeleton's ``llmbus-ready gateway <id>`` line.
On SIGINT/SIGTERM it stops taking requests, lets streams in flight end, then drains NATS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys

import uvicorn

from llmbus import aio
from llmbus.bus.service import ServiceContext, ServiceOptions, add_common_args, run_service, setup_logging
from llmbus.bus.streams import ensure_responses_bucket
from services.gateway.app import build_app
from services.gateway.bus_client import GatewayBus
from services.gateway.limits import keep_buckets, load_buckets, share_usage
from services.gateway.config import GatewayConfig, ModelSpec
from services.gateway.handlers import Gateway
from services.gateway.limits import TenantLimits
from services.gateway.listen import bind
from services.gateway.tools import PARSERS
from services.gateway.models import ModelRegistry
from services.gateway.stored import ResponseStore
from services.gateway.tenants import Tenants


def parse_args(argv: list[str] | None = None) -> tuple[GatewayConfig, str, str]:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description="llmbus OpenAI-compatible gateway")
    add_common_args(p)
    p.add_argument("--model", action="append", required=True, metavar="NAME=DIR", help="a served model (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (see the listening line)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--max-model-len", type=int, default=None, help="shorten every model's context to this (the workers' --max-model-len)")
    p.add_argument("--token-timeout", type=float, default=60.0, help="seconds of token-stream silence before failing "
                   "(while the model's workers are busy: queued, waits up to --request-timeout)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="request deadline in seconds: a request still generating this long after it was "
                        "accepted is ended by its worker (503 aborted)")
    p.add_argument("--api-keys-file", default=None,
                   help="JSON {api key: tenant} (keys of 8+ printable characters, no spaces): /v1 answers only listed keys (Authorization: Bearer KEY), and "
                        "tenants never share prefix-cache blocks (default: open, one shared cache)")
    p.add_argument("--tool-parser", default=None, choices=PARSERS,
                   help="read tool calls in chat output (hermes: <tool_call>{json}</tool_call>, Qwen2.5 and "
                        "Hermes models; llama3_json: the answer is {\"name\", \"parameters\"}, Llama 3.1+; "
                        "mistral: [TOOL_CALLS] [{\"name\", \"arguments\"}], Mistral v0.3, Mixtral 8x22B, NeMo); "
                        "without it requests with tools are refused")
    p.add_argument("--tenant-limits", default=None, metavar="FILE",
                   help="JSON {\"default\": {limits}, \"tenants\": {tenant: {limits}}}, limits being any of "
                        "requests_per_minute, tokens_per_minute, requests_per_day, tokens_per_day, "
                        "max_concurrent_requests: a tenant over one gets 429 "
                        "with Retry-After (default: no limits)")
    p.add_argument("--responses-ttl", type=float, default=86400.0, metavar="S",
                   help="keep Responses API answers (store: true, the default) S seconds, for previous_response_id "
                        "and GET/DELETE /v1/responses/{id}, in the bus's KV bucket llmbus_responses "
                        "(default a day; 0: store nothing)")
    p.add_argument("--responses-max-bytes", type=int, default=1 << 30, metavar="N",
                   help="the stored answers' size in all (default 1 GiB; set by the gateway that creates the bucket)")
    a = p.parse_args(argv)
    models = tuple(ModelSpec.parse(m, a.max_model_len) for m in a.model)
    config = GatewayConfig(nats_url=a.nats_url, models=models, host=a.host, port=a.port,
                           max_body_bytes=a.max_body_bytes, token_timeout_s=a.token_timeout,
                           request_timeout_s=a.request_timeout, api_keys_file=a.api_keys_file,
                           tool_parser=a.tool_parser, tenant_limits_file=a.tenant_limits,
                           responses_ttl_s=a.responses_ttl, responses_max_bytes=a.responses_max_bytes)
    return config, a.instance_id, a.log_level


class _Server(uvicorn.Server):
    """uvicorn without its own signal capture (it re-raises the signal after shutdown, which would
    kill us before the NATS drain): the service skeleton's handlers set ``ctx.stop`` instead."""

    def capture_signals(self):
        return contextlib.nullcontext()


async def serve_http(gw: Gateway, ctx: ServiceContext, sock: socket.socket) -> None:
    """The service body: serve until ``ctx.stop``; then stop accepting, let streams in flight end."""
    config = gw.config
    gw.bus = GatewayBus(ctx.nc, ctx.instance_id)
    await gw.bus.start()
    if config.responses_ttl_s > 0:
        gw.responses = ResponseStore(await ensure_responses_bucket(ctx.js, config.responses_ttl_s,
                                                                   config.responses_max_bytes))  # fmt: skip
    sharing = None
    if gw.limiter is not None:  # the fleet's use so far, then what changes: before the first request
        kv = await load_buckets(gw.limiter, ctx.js)
        sharing = asyncio.gather(share_usage(gw.limiter, ctx.nc, ctx.instance_id), keep_buckets(gw.limiter, kv))
    try:
        server = _Server(uvicorn.Config(build_app(gw), host=config.host, port=config.port, log_level="warning",
                                        lifespan="off", timeout_graceful_shutdown=30))
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if not server.started:
            await serving
            raise RuntimeError(f"the HTTP server did not start on {config.host}:{config.port}")
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        print(f"llmbus gateway listening http://{host}:{port}", flush=True)
        await ctx.ready()
        stopping = asyncio.ensure_future(ctx.stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        server.should_exit = True
        await serving
    finally:
        if sharing is not None:  # NOTE: after the last answers: it saves the buckets once more
            sharing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sharing


def main(argv: list[str] | None = None) -> int:
    try:
        config, instance_id, log_level = parse_args(argv)
        setup_logging(log_level)
        tenants = Tenants.load(config.api_keys_file) if config.api_keys_file else None
        limits = TenantLimits.load(config.tenant_limits_file) if config.tenant_limits_file else None
        gw = Gateway(config, ModelRegistry.load(config.models), tenants=tenants, limits=limits)  # before connecting: fail fast
        sock = bind(config.host, config.port)  # and a port that cannot be had
        options = ServiceOptions(role="gateway", nats_url=config.nats_url, instance_id=instance_id,
                                 models=tuple(m.name for m in config.models))
        with sock:
            return aio.run(run_service(options, lambda ctx: serve_http(gw, ctx, sock)))
    except (ValueError, FileNotFoundError, ConnectionError) as exc:
        print(f"gateway: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
