"""Command-line parsing the engine-driving services (prefill, decode) and `llmbus up` share."""

from __future__ import annotations

from llmbus.bus.subjects import check_model_names


def parse_model_spec(spec: str) -> tuple[str, str]:
    """``NAME=DIR`` -> (name, dir). A bare ``DIR`` is named by its last path component."""
    name, sep, path = spec.partition("=")
    if not sep:
        path = spec
        name = spec.rstrip("/").rsplit("/", 1)[-1]
    if not name or not path:
        raise ValueError(f"--model must be NAME=DIR, got {spec!r}")
    check_model_names([name])
    return name, path
