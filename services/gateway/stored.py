"""Responses API answers kept for later (``store``, on by default as at OpenAI): the KV bucket
``llmbus_responses`` holds, under each response's id, its ``response`` object, the conversation
that led to it as chat messages (ending with the answer's own turn), and its tenant. Any gateway on
the bus can then continue it (``previous_response_id``), show it (``GET /v1/responses/{id}``) or
delete it (``DELETE``); another tenant's id is as unknown as a missing one (404)."""

from __future__ import annotations

import logging

import orjson

from services.gateway.errors import APIError

log = logging.getLogger("llmbus.gateway")


class ResponseStore:
    """``kv`` None: nothing is stored (``--responses-ttl 0``)."""

    def __init__(self, kv=None) -> None:
        self.kv = kv

    @property
    def on(self) -> bool:
        return self.kv is not None

    async def load(self, response_id: str, tenant: str, param: str | None = None) -> dict:
        """The stored record (``response``, ``messages``, ``tenant``); 404 when there is none."""
        record = None
        if self.kv is not None and _valid(response_id):
            try:
                entry = await self.kv.get(response_id)
                record = orjson.loads(entry.value) if entry.value else None
            except Exception as exc:  # KeyNotFoundError; a deleted key
                log.debug("no stored response %s: %s", response_id, exc)
        if record is None or record.get("tenant") != tenant:
            raise APIError(404, f"Response with id '{response_id}' not found.", type="invalid_request_error",
                           param=param, code="not_found" if param is None else "previous_response_not_found")
        return record

    async def save(self, response: dict, messages: list[dict], tenant: str) -> bool:
        """Whether it was stored (a full bucket, a lost connection: not, and the answer says so)."""
        if self.kv is None:
            return False
        try:
            await self.kv.put(response["id"], orjson.dumps({"response": response, "messages": messages, "tenant": tenant}))
        except Exception as exc:
            log.warning("could not store response %s: %s", response["id"], exc)
            return False
        return True

    async def delete(self, response_id: str, tenant: str) -> None:
        await self.load(response_id, tenant)  # (404 first)
        await self.kv.delete(response_id)


def _valid(response_id: str) -> bool:
    return response_id.startswith("resp_") and response_id[5:].isalnum() and len(response_id) <= 64
