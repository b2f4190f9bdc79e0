"""A bus that asks for credentials: a real nats-server with user/password or token authorization;
services take the URL with its credentials from ``$LLMBUS_NATS_URL`` (off their command lines) and
never print the secret."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest

from llmbus.bus.connection import NATS_URL_ENV, connect, default_nats_url, has_credentials, redact
from llmbus.bus.server import EmbeddedNats, NatsServerConfig
from llmbus.launch import _plan

SECRET = "s3cret-pw"


def run(coro):
    return asyncio.run(coro)


async def _roundtrip(url: str) -> bytes:
    nc = await connect(url, first_connect_s=3.0)
    try:
        sub = await nc.subscribe("auth.check")
        await nc.publish("auth.check", b"hello")
        msg = await sub.next_msg(timeout=2)
        return msg.data
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def password_server(tmp_path_factory):
    with EmbeddedNats(tmp_path_factory.mktemp("nats-auth"), NatsServerConfig(user="llmbus", password=SECRET)) as s:
        yield s


def test_redact_hides_users_passwords_and_tokens():
    assert redact("nats://u:p@h:4222") == "nats://***@h:4222"
    assert redact("nats://tok@h:4222,tls://a:b@g:4223") == "nats://***@h:4222,tls://***@g:4223"
    assert redact("nats://h:4222") == "nats://h:4222"
    assert has_credentials("nats://tok@h:1") and not has_credentials("nats://h:1")


def test_a_password_server_admits_its_user_only(password_server):
    assert SECRET not in password_server.url and password_server.client_url.startswith("nats://llmbus:")
    assert run(_roundtrip(password_server.client_url)) == b"hello"
    with pytest.raises(ConnectionError) as refused:
        run(connect(password_server.url, first_connect_s=1.5))  # no credentials
    assert "127.0.0.1" in str(refused.value)
    wrong = password_server.client_url.replace(SECRET, "not-the-" + SECRET)
    with pytest.raises(ConnectionError) as refused:
        run(connect(wrong, first_connect_s=1.5))
    assert SECRET not in str(refused.value) and "***@" in str(refused.value)


def test_a_token_server(tmp_path):
    with EmbeddedNats(tmp_path, NatsServerConfig(token="tok-123")) as server:
        assert server.client_url.startswith("nats://tok-123@")
        assert run(_roundtrip(server.client_url)) == b"hello"
        with pytest.raises(ConnectionError):
            run(connect(server.url, first_connect_s=1.5))


def test_credentials_are_refused_where_they_would_break_the_config_or_url():
    with pytest.raises(ValueError, match="letters, digits"):
        NatsServerConfig(token='a" }')
    with pytest.raises(ValueError, match="together"):
        NatsServerConfig(user="u")
    with pytest.raises(ValueError, match="not both"):
        NatsServerConfig(user="u", password="p", token="t")


def _service(env_url: str | None, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != NATS_URL_ENV}
    if env_url is not None:
        env[NATS_URL_ENV] = env_url
    return subprocess.Popen([sys.executable, "-m", "services.router", "--models", "m", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_service_takes_the_url_from_the_environment_and_never_prints_the_secret(password_server):
    proc = _service(password_server.client_url)
    watchdog = threading.Timer(60, proc.kill)  # a router silent for a minute ends the read below
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("llmbus-ready router"):
                break
        assert any(line.startswith("llmbus-ready router") for line in lines), "".join(lines)
    finally:
        watchdog.cancel()
        proc.terminate()
        out = "".join(lines) + proc.communicate(timeout=30)[0]
    assert SECRET not in out
    # a wrong password: a one-line error naming the server, not the secret, and exit 1
    wrong = password_server.client_url.replace(SECRET, "not-the-" + SECRET)
    proc = _service(None, "--nats-url", wrong)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1
    assert "router: error: cannot connect to NATS at nats://***@127.0.0.1:" in out and SECRET not in out


def test_default_url_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(NATS_URL_ENV, raising=False)
    assert default_nats_url() == "nats://127.0.0.1:4222"
    monkeypatch.setenv(NATS_URL_ENV, "nats://t@h:1")
    assert default_nats_url() == "nats://t@h:1"


def test_up_keeps_credentials_off_the_services_command_lines(tmp_path):
    from llmbus.cli import build_parser
    from llmbus.model.demo import write_random_model

    model = str(write_random_model(tmp_path / "m", {"num_hidden_layers": 1}))
    args = build_parser().parse_args(["up", "--model", f"m={model}", "--colocated"])
    with_secret = _plan(args, "nats://llmbus:" + SECRET + "@127.0.0.1:4222", [("m", model)])
    plain = _plan(args, "nats://127.0.0.1:4222", [("m", model)])
    assert all(SECRET not in " ".join(c.argv) and "--nats-url" not in c.argv for c in with_secret)
    assert all("--nats-url" in c.argv for c in plain)
