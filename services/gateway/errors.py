"""OpenAI-format errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

import orjson
from starlette.responses import Response


class APIError(Exception):
    """An error the client sees. Raised anywhere in request handling; the app renders it."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(orjson.dumps(self.body()), status_code=self.status, media_type="application/json",
                        headers=self.headers)


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def missing(param: str) -> APIError:
    return APIError(400, f"Missing required parameter: '{param}'.", param=param,
                    code="missing_required_parameter")


def wrong_type(param: str, expected: str, value: object) -> APIError:
    got = "null" if value is None else _json_type(value)
    return APIError(400, f"Invalid type for '{param}': expected {expected}, but got {got} instead.",
                    param=param, code="invalid_type")


def server_error(message: str, status: int = 500, code: str | None = "internal_error") -> APIError:
    return APIError(status, message, type="server_error", code=code)


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
