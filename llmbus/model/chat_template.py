"""Chat templates rendered the way Hugging Face renders them (torch-free).

A sandboxed, immutable jinja2 environment with ``trim_blocks``/``lstrip_blocks``, loop controls,
a ``raise_exception`` global, ``strftime_now`` and a non-ASCII-escaping ``tojson``. Any template
problem, at compile or render time, surfaces as a ValueError.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_ENV = _environment()


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role'")


class ChatTemplate:
    """A compiled chat template; ``render`` is cheap and thread-safe."""

    def __init__(self, source: str) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ValueError("chat template must be a non-empty string")
        self.source = source
        try:
            self._template = _ENV.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from None

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **variables: Any) -> str:
        """Render ``messages``; ``variables`` (bos_token, eos_token, tools, ...) reach the template."""
        _check_messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from None
        except (TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"chat template failed on these messages: {type(exc).__name__}: {exc}") from None
