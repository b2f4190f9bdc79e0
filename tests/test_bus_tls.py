"""TLS to the bus: a real nats-server that requires TLS and verifies clients' certificates
(certificates made here with openssl), reached by ``connect`` and by a real service through
``$LLMBUS_NATS_TLS_*``; a client that asked for TLS refuses a server that would take it in plain
TCP."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmbus.bus.connection import TLS_CA_ENV, TLS_CERT_ENV, TLS_ENVS, TLS_KEY_ENV, connect
from llmbus.bus.server import EmbeddedNats, NatsServerConfig
from llmbus.bus.service import READY_PREFIX

ROOT = Path(__file__).resolve().parent.parent


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 signed by it, and a client certificate signed by it."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make certificates")
    d = tmp_path_factory.mktemp("pki")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=llmbus test CA", cwd=d)  # fmt: skip
    for name, extra in (("server", ["-extfile", "san.cnf"]), ("client", [])):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=llmbus {name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", *extra, cwd=d)  # fmt: skip
    return d


@pytest.fixture(scope="module")
def tls_server(pki, tmp_path_factory) -> str:
    """URL of a nats-server with JetStream that requires TLS and a client certificate signed by the CA."""
    config = NatsServerConfig(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                              tls_verify_ca=str(pki / "ca.pem"))  # fmt: skip
    with EmbeddedNats(tmp_path_factory.mktemp("nats-tls"), config) as server:
        yield server.url


def _tls_env(monkeypatch, pki: Path, *, cert: bool = True) -> None:
    monkeypatch.setenv(TLS_CA_ENV, str(pki / "ca.pem"))
    if cert:
        monkeypatch.setenv(TLS_CERT_ENV, str(pki / "client.pem"))
        monkeypatch.setenv(TLS_KEY_ENV, str(pki / "client.key"))


def _connect_error(url: str) -> str:
    async def attempt():
        with pytest.raises(ConnectionError) as caught:
            await connect(url, first_connect_s=3)
        return str(caught.value)

    return asyncio.run(attempt())


def test_a_client_with_the_ca_and_its_certificate_uses_jetstream_over_tls(tls_server, pki, monkeypatch, caplog):
    _tls_env(monkeypatch, pki)

    async def body():
        nc = await connect(tls_server)
        try:
            js = nc.jetstream()
            await js.add_stream(name="TLSCHECK", subjects=["tlscheck.>"])
            ack = await js.publish("tlscheck.one", b"over tls")
            sub = await js.pull_subscribe("tlscheck.one", durable="tlscheck")
            (msg,) = await sub.fetch(1, timeout=5)
            await msg.ack()
            return nc._server_info.get("tls_required"), ack.seq, msg.data
        finally:
            await nc.close()

    assert asyncio.run(body()) == (True, 1, b"over tls")
    # asyncio's warning at every TLS close ("eof_received() has no effect when using ssl") is not ours to show
    assert not [r for r in caplog.records if "eof_received" in r.getMessage()]


def test_llmbus_up_keeps_tls_settings_from_services_on_its_embedded_server(monkeypatch):
    """The embedded server speaks plain TCP on 127.0.0.1: services told to ask for TLS would
    refuse it and ``llmbus up`` would fail to start."""
    import os

    from llmbus.launch import drop_tls_settings

    monkeypatch.setenv(TLS_CA_ENV, "/some/ca.pem")
    monkeypatch.setenv(TLS_KEY_ENV, "/some/key.pem")
    monkeypatch.delenv(TLS_CERT_ENV, raising=False)
    assert drop_tls_settings() == [TLS_CA_ENV, TLS_KEY_ENV]
    assert not set(TLS_ENVS) & set(os.environ) and drop_tls_settings() == []


def test_without_the_right_settings_the_tls_server_is_not_reached(tls_server, pki, monkeypatch):
    for name in TLS_ENVS:
        monkeypatch.delenv(name, raising=False)
    assert "CERTIFICATE_VERIFY_FAILED" in _connect_error(tls_server)  # the system's CAs do not know ours
    _tls_env(monkeypatch, pki, cert=False)
    assert "CERTIFICATE_REQUIRED" in _connect_error(tls_server)  # the server verifies clients


@pytest.mark.parametrize("how", ["tls-url", "tls-settings"])
def test_a_client_that_asked_for_tls_refuses_a_plain_server(nats_server, pki, monkeypatch, how):
    """Not a word in plain TCP (CONNECT carries the credentials): refused when the server's INFO
    says it does not require TLS."""
    if how == "tls-url":
        url = nats_server.replace("nats://", "tls://", 1)
    else:
        url = nats_server
        _tls_env(monkeypatch, pki)
    assert "TLS was asked for, but this server does not require it" in _connect_error(url)


def test_tls_files_that_cannot_be_used_are_named(pki, monkeypatch, tmp_path):
    monkeypatch.setenv(TLS_CA_ENV, str(tmp_path / "missing.pem"))
    assert f"cannot use {TLS_CA_ENV}=" in _connect_error("tls://127.0.0.1:1")
    monkeypatch.setenv(TLS_CA_ENV, str(pki / "ca.pem"))
    monkeypatch.setenv(TLS_CERT_ENV, str(pki / "client.pem"))
    monkeypatch.setenv(TLS_KEY_ENV, str(pki / "server.key"))  # not the certificate's key
    assert f"cannot use {TLS_CERT_ENV}=" in _connect_error("tls://127.0.0.1:1")
    monkeypatch.delenv(TLS_CERT_ENV)
    assert f"{TLS_KEY_ENV} is set but {TLS_CERT_ENV}" in _connect_error("tls://127.0.0.1:1")


def test_a_service_serves_over_tls_and_says_why_it_cannot(tls_server, pki, monkeypatch):
    """kvpool as a user runs it: with the settings in its environment it starts and answers over
    TLS; with a CA file that is not there it exits 1 naming the variable."""
    from llmbus.bus.kvclient import KVPoolClient

    _tls_env(monkeypatch, pki)
    cmd = [sys.executable, "-m", "services.kvpool", "--nats-url", tls_server, "--block-bytes", "4096",
           "--capacity-blocks", "4", "--log-level", "WARNING"]  # fmt: skip
    kvpool = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert kvpool.stdout.readline().startswith(f"{READY_PREFIX} kvpool ")

        async def stats():
            nc = await connect(tls_server)
            try:
                return await KVPoolClient(nc, transport="bus").stats()
            finally:
                await nc.close()

        assert asyncio.run(stats()).capacity_blocks == 4
    finally:
        kvpool.terminate()
        kvpool.wait(timeout=20)
        kvpool.stdout.close()
    monkeypatch.setenv(TLS_CA_ENV, str(pki / "missing.pem"))
    failed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1
    assert f"cannot use {TLS_CA_ENV}=" in failed.stderr and "Traceback" not in failed.stderr
