"""Fixtures shared by the end-to-end suites."""

from __future__ import annotations

import pytest

from llmbus.model.demo import make_demo_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The small demo model, written once per session through the real generator."""
    path = tmp_path_factory.mktemp("e2e-model") / "demo-small"
    make_demo_model(path, "small")
    return path
