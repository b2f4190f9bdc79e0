"""Opening a NATS connection with the reconnect behaviour every llmbus service wants."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client

log = logging.getLogger("llmbus.bus")


class _Client(Client):
    """nats-py's client, except that a message whose headers it cannot parse loses its headers
    instead of the connection. nats-py 2.16 decodes an inline status line (``NATS/1.0 <status>``)
    outside its own guard: one message with non-UTF-8 bytes there, which any client may publish,
    raised out of the read loop and left the connection deaf until the ping timeout."""

    async def _process_headers(self, headers):
        try:
            return await super()._process_headers(headers)
        except UnicodeDecodeError as exc:
            log.warning("dropping a message's unreadable headers: %s", exc)
            return None


async def connect(
    url: str, *, name: str = "llmbus", connect_timeout: float = 5.0, first_connect_s: float = 10.0
) -> Client:
    """Connect to ``url`` (comma-separated for a cluster); once connected, reconnect forever, 0.5 s apart.

    Raises ``ConnectionError`` naming the URL when no connection is made within ``first_connect_s``.
    """
    if not url:
        raise ValueError("a NATS URL is required, e.g. nats://127.0.0.1:4222")
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        msg = str(exc) or type(exc).__name__
        if not errors or errors[-1] != msg:  # NOTE: nats retries every 0.5 s; log each new error once
            log.warning("nats %s: %s", name, msg)
        errors.append(msg)

    async def on_disconnect() -> None:
        log.warning("nats %s: disconnected", name)

    async def on_reconnect() -> None:
        log.info("nats %s: reconnected", name)

    nc = _Client()
    opening = nc.connect(
        servers=[u.strip() for u in url.split(",") if u.strip()],
        name=name,
        connect_timeout=connect_timeout,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        ping_interval=10,
        max_outstanding_pings=3,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
    try:
        await asyncio.wait_for(opening, first_connect_s)
        return nc
    except Exception as exc:  # nats raises NoServersError, OSError, TimeoutError...
        why = errors[-1] if errors else (str(exc) or type(exc).__name__)
        raise ConnectionError(f"cannot connect to NATS at {url}: {why}") from None
