"""Shared fixtures: one real nats-server (JetStream, temporary store, random port) per test session."""

from __future__ import annotations

import pytest

from llmbus.bus.server import EmbeddedNats


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory) -> str:
    """URL of a nats-server started for this test session and stopped after it."""
    with EmbeddedNats(tmp_path_factory.mktemp("nats")) as server:
        yield server.url
