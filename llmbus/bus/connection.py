"""Opening a NATS connection with the reconnect behaviour every llmbus service wants."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl

from nats import errors as nats_errors
from nats.aio.client import Client

log = logging.getLogger("llmbus.bus")

# NOTE: where a NATS URL with credentials (nats://user:password@host, nats://token@host) can be
# given without putting them on a command line, which any local user can read in ps
NATS_URL_ENV = "LLMBUS_NATS_URL"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
_USERINFO = re.compile(r"(?<=://)[^/@,\s]*@")
# TLS to the bus, for every service alike (``llmbus up`` passes its environment on): the CA bundle
# that signed the servers' certificates (else the system's), and this client's certificate and
# key for servers that verify clients (nats-server ``tls { verify: true }``)
TLS_CA_ENV = "LLMBUS_NATS_TLS_CA"
TLS_CERT_ENV = "LLMBUS_NATS_TLS_CERT"
TLS_KEY_ENV = "LLMBUS_NATS_TLS_KEY"
TLS_ENVS = (TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV)
# what nats-py reports after the error that mattered (a TLS refusal): the connection closing
_FOLLOW_ON = (ConnectionResetError, BrokenPipeError, nats_errors.UnexpectedEOF)


def default_nats_url() -> str:
    """``$LLMBUS_NATS_URL``, else the local default."""
    return os.environ.get(NATS_URL_ENV, "").strip() or DEFAULT_NATS_URL


class _QuietTlsClose(logging.Filter):
    """asyncio warns "returning true from eof_received() has no effect when using ssl" each time
    a TLS connection to the bus closes (nats-py's protocol returns True there): nothing is wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


def tls_context(url: str) -> ssl.SSLContext | None:
    """The TLS settings ``$LLMBUS_NATS_TLS_*`` and ``url`` ask for (a ``tls://`` server, or any of
    those variables set), or None: plain TCP unless the server requires TLS, which nats-py then
    speaks with the system's CA bundle. Raises ``ConnectionError`` naming the variable whose file
    cannot be used."""
    ca, cert, key = (os.environ.get(name, "").strip() for name in TLS_ENVS)
    if not (ca or cert or key or "tls://" in url):
        return None
    if not any(isinstance(f, _QuietTlsClose) for f in logging.getLogger("asyncio").filters):
        logging.getLogger("asyncio").addFilter(_QuietTlsClose())
    if key and not cert:
        raise ConnectionError(f"{TLS_KEY_ENV} is set but {TLS_CERT_ENV}, the certificate it goes with, is not")
    try:
        context = ssl.create_default_context(cafile=ca or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConnectionError(f"cannot use {TLS_CA_ENV}={ca}: {exc}") from None
    if cert:
        try:
            context.load_cert_chain(cert, key or None)
        except (OSError, ssl.SSLError) as exc:
            raise ConnectionError(f"cannot use {TLS_CERT_ENV}={cert}" + (f" with {TLS_KEY_ENV}={key}" if key else "")
                                  + f": {exc}") from None  # fmt: skip
    return context


def has_credentials(url: str) -> bool:
    return bool(_USERINFO.search(url))


def redact(url: str) -> str:
    """``url`` (comma-separated ones too) with any user, password or token shown as ``***``: for
    messages and logs."""
    return _USERINFO.sub("***@", url)


class _Client(Client):
    """nats-py's client, hardened against messages it cannot read. In nats-py 2.16 a subject or
    reply subject that is not UTF-8, an inline status line (``NATS/1.0 <status>``) that is not, or
    a header block too short to hold a status, raised out of the read loop: the connection stayed
    up but heard nothing until the ping timeout (~40 s). Any client may publish such a message on a
    subject a service listens on (an abort subject reaches every worker).

    Subjects are decoded with replacement characters, so such a message still reaches its
    subscriber (a stream's consumer can then ack or term it, and a KV watcher's bookkeeping stays
    whole); whatever else raises drops that one message, logged once at WARNING and then at DEBUG."""

    _unreadable = 0
    require_tls = False  # TLS was asked for: a server that does not require it is refused

    async def _process_info(self, info, initial_connection=False):
        # NOTE: here the server's INFO is read and nothing sent yet: nats-py would go on in plain
        # TCP with a server that does not require TLS (a tls:// URL included), CONNECT and its
        # credentials in the clear
        if self.require_tls and initial_connection and not info.get("tls_required"):
            raise nats_errors.Error("TLS was asked for, but this server does not require it (a tls block without "
                                    "allow_non_tls): not connecting in plain TCP")  # fmt: skip
        return await super()._process_info(info, initial_connection)

    async def _request_new_style(self, subject, payload, timeout=1, headers=None):
        # NOTE: nats-py files the reply's future before it publishes and forgets it only once it
        # resolves: a publish that raises (the reconnect buffer full, say) left one behind for good,
        # one per request made during an outage. What that publish would refuse is refused first.
        if len(payload) > self._max_payload:
            raise nats_errors.MaxPayloadError
        if not self.is_connected and (self._max_pending_size <= 0
                                      or len(payload) + self._pending_data_size > self._max_pending_size):
            raise nats_errors.OutboundBufferLimitError
        return await super()._request_new_style(subject, payload, timeout, headers)

    def _build_message(self, sid, subject, reply, data, headers):
        try:
            return super()._build_message(sid, subject, reply, data, headers)
        except UnicodeDecodeError:
            subject, reply = (bytes(b).decode(errors="replace").encode() for b in (subject, reply))
            return super()._build_message(sid, subject, reply, data, headers)

    async def _process_msg(self, sid, subject, reply, data, headers) -> None:
        try:
            await super()._process_msg(sid, subject, reply, data, headers)
        except Exception as exc:  # NOTE: the parser has consumed the message: the stream stays in step
            self._unreadable += 1
            level = logging.WARNING if self._unreadable == 1 else logging.DEBUG
            log.log(level, "dropped a message nats-py cannot read (%d so far; subject %r): %r",
                    self._unreadable, bytes(subject)[:200], exc)


async def connect(
    url: str, *, name: str = "llmbus", connect_timeout: float = 5.0, first_connect_s: float = 10.0
) -> Client:
    """Connect to ``url`` (comma-separated for a cluster); once connected, reconnect forever, 0.5 s apart.

    Raises ``ConnectionError`` naming the URL when no connection is made within ``first_connect_s``.
    """
    if not url:
        raise ValueError("a NATS URL is required, e.g. nats://127.0.0.1:4222")
    tls = tls_context(url)
    errors: list[str] = []  # the last one only: the connection lives for days

    async def on_error(exc: Exception) -> None:
        msg = str(exc) or type(exc).__name__
        if not errors or errors[-1] != msg:  # NOTE: nats retries every 0.5 s; log each new error once
            log.warning("nats %s: %s", name, redact(msg))
        if not isinstance(exc, _FOLLOW_ON) or not errors:  # NOTE: after a TLS refusal, say why, not what followed
            errors[:] = [msg]

    async def on_disconnect() -> None:
        if nc.is_closed or nc.is_draining:  # our own close or drain: nothing went wrong
            log.debug("nats %s: closed", name)
            return
        log.warning("nats %s: disconnected", name)

    async def on_reconnect() -> None:
        log.info("nats %s: reconnected", name)

    nc = _Client()
    nc.require_tls = tls is not None
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
        **({"tls": tls} if tls is not None else {}),
    )
    try:
        await asyncio.wait_for(opening, first_connect_s)
        return nc
    except Exception as exc:  # nats raises NoServersError, OSError, TimeoutError...
        why = errors[-1] if errors else (str(exc) or type(exc).__name__)
        raise ConnectionError(f"cannot connect to NATS at {redact(url)}: {redact(why)}") from None
