"""API keys and the tenants they name.

With ``--api-keys-file`` the gateway answers ``/v1/*`` only to ``Authorization: Bearer <key>`` with
a listed key (401 ``invalid_api_key`` otherwise), and the key's tenant becomes every one of its
requests' ``cache_salt``: the prefix caches (every worker's, and kvpool's tiers) hash it into each
block's identity, so one tenant never reads, nor learns by its ``cached_tokens`` or its time to
first token, what another tenant's prompts left cached. Without the file the gateway is open and
every request shares one cache, as one tenant's would.

The file is a JSON object, ``{"<api key>": "<tenant>", ...}``; several keys may name one tenant.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from services.gateway.config import read_json_file
from services.gateway.errors import APIError

MAX_TENANT_CHARS = 128


class Tenants:
    def __init__(self, keys: dict[str, str]) -> None:
        self._keys = [(k.encode(), tenant) for k, tenant in keys.items()]

    @classmethod
    def load(cls, path: str | Path) -> Tenants:
        """Read an API keys file; ValueError (one line, no key in it) when it is not usable."""
        keys = read_json_file(path, "the API keys file")
        if not isinstance(keys, dict) or not keys:
            raise ValueError(f"the API keys file {path} must hold a non-empty JSON object {{key: tenant}}")
        for i, (key, tenant) in enumerate(keys.items()):
            if not key or len(key) < 8 or not key.isprintable() or " " in key:
                raise ValueError(f"the API keys file {path}: key {i + 1} must be 8 or more printable characters, no spaces")
            if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_CHARS:
                raise ValueError(f"the API keys file {path}: key {i + 1}'s tenant must be a string of 1-"
                                 f"{MAX_TENANT_CHARS} characters")
        return cls(keys)

    def tenant(self, authorization: str | None) -> str:
        """The tenant of an ``Authorization`` header's bearer key; APIError 401 when there is none."""
        scheme, _, key = (authorization or "").partition(" ")
        given = key.strip().encode() if scheme.lower() == "bearer" else b""
        found = None
        for known, tenant in self._keys:  # NOTE: every key compared, in constant time each
            if hmac.compare_digest(known, given) and given:
                found = tenant
        if found is None:
            raise APIError(401, "Incorrect API key provided: send a listed key as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
        return found
