"""The gateway's configuration: one frozen dataclass, validated at construction."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llmbus.bus.subjects import check_model_names
from services.gateway.tools import PARSERS


def read_json_file(path: str | Path, what: str) -> object:
    """A JSON file the gateway is started with (``what``: "the API keys file"); ValueError with a
    one-line message, quoting nothing of its content, when it cannot be read or parsed."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not JSON: {exc.msg} (line {exc.lineno})") from None


@dataclass(frozen=True)
class ModelSpec:
    """One served model: the public name clients send and the Hugging Face style directory."""

    name: str
    path: str
    max_model_len: int | None = None  # None: config.json max_position_embeddings

    def __post_init__(self) -> None:
        check_model_names([self.name])
        if not self.path:
            raise ValueError(f"model {self.name!r}: directory must be given")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"model {self.name!r}: max_model_len must be >= 2, got {self.max_model_len}")

    @classmethod
    def parse(cls, text: str, max_model_len: int | None = None) -> "ModelSpec":
        """Parse ``NAME=DIR`` (the --model flag)."""
        name, sep, path = text.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--model expects NAME=DIR, got {text!r}")
        return cls(name=name.strip(), path=path.strip(), max_model_len=max_model_len)


@dataclass(frozen=True)
class GatewayConfig:
    nats_url: str
    models: tuple[ModelSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 1024 * 1024
    token_timeout_s: float = 60.0  # longest silence on a token subject before the stream fails
    request_timeout_s: float = 600.0  # the request's deadline, sent to workers
    max_stop_strings: int = 16
    api_keys_file: str | None = None  # JSON {key: tenant} (services/gateway/tenants.py); None: open
    tool_parser: str | None = None  # how tool calls read in the models' output (tools.PARSERS); None: no tools
    tenant_limits_file: str | None = None  # JSON limits per tenant (services/gateway/limits.py); None: none
    responses_ttl_s: float = 86400.0  # how long stored Responses answers are kept (0: none is stored)
    responses_max_bytes: int = 1 << 30  # the store's whole size (the bucket's creator sets it)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        if not self.nats_url:
            raise ValueError("nats_url must be given")
        if not self.models:
            raise ValueError("at least one --model NAME=DIR is required")
        check_model_names(m.name for m in self.models)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.responses_ttl_s < 0:
            raise ValueError(f"responses_ttl_s must be >= 0 (0: store no responses), got {self.responses_ttl_s}")
        if self.responses_max_bytes < 1024:
            raise ValueError(f"responses_max_bytes must be >= 1024, got {self.responses_max_bytes}")
        if self.token_timeout_s <= 0:
            raise ValueError(f"token_timeout_s must be > 0, got {self.token_timeout_s}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.tool_parser is not None and self.tool_parser not in PARSERS:
            raise ValueError(f"--tool-parser must be one of {', '.join(PARSERS)}, got {self.tool_parser!r}")
