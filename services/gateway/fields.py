"""Typed getters for JSON request fields: each names the field in the error it raises.

A field set to null counts as absent (the OpenAI API accepts null for every optional field).
"""

from __future__ import annotations

from typing import Any

from llmbus.engine.sampling_params import MAX_LOGIT_BIAS_TOKENS as MAX_LOGIT_BIAS
from services.gateway.errors import invalid, missing, wrong_type


def get_str(body: dict, name: str, *, required: bool = False, default: str | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise missing(name)
        return default
    if not isinstance(value, str):
        raise wrong_type(name, "a string", value)
    return value


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise wrong_type(name, "a boolean", value)
    return value


def get_int(body: dict, name: str, *, lo: int | None = None, hi: int | None = None,
            default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and abs(value) >= 2**63:
        # (the JSON parser reads an integer past 64 bits as a float: say what it was)
        raise invalid(f"Invalid value for '{name}': {value:.0f} is too large (integers must fit in 64 bits).", name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(name, "an integer", value)
    _check_range(name, value, lo, hi)
    return value


def get_float(body: dict, name: str, *, lo: float | None = None, hi: float | None = None,
              default: float | None = None, lo_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(name, "a number", value)
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise invalid(f"'{name}' must be a finite number.", name)
    if lo_open and lo is not None and value <= lo:
        raise invalid(f"Invalid value for '{name}': {value} must be greater than {lo}.", name)
    _check_range(name, value, None if lo_open else lo, hi)
    return value


def get_dict(body: dict, name: str) -> dict | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise wrong_type(name, "an object", value)
    return value


def get_stop(body: dict, name: str, limit: int) -> tuple[str, ...]:
    """``stop``: a string or a list of strings."""
    value: Any = body.get(name)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise wrong_type(name, "a string or an array of strings", value)
    if len(value) > limit:
        raise invalid(f"'{name}' accepts at most {limit} strings, got {len(value)}.", name)
    if any(s == "" for s in value):
        raise invalid(f"'{name}' must not contain empty strings.", name)
    return tuple(dict.fromkeys(value))


def get_int_list(body: dict, name: str) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise wrong_type(name, "an array of integers", value)
    return tuple(value)


def get_logit_bias(body: dict, name: str) -> list[tuple[int, float]]:
    """OpenAI's ``logit_bias``: an object mapping token ids (JSON keys, so strings) to biases in
    [-100, 100]; as (token id, bias) pairs."""
    value = get_dict(body, name) or {}
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"'{name}' takes at most {MAX_LOGIT_BIAS} tokens, got {len(value)}.", name)
    out = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid(f"'{name}' keys must be token ids (non-negative integers), got {key!r}.", name)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise invalid(f"'{name}' values must be numbers from -100 to 100, got {bias!r} for token {key}.", name)
        out.append((int(key), float(bias)))
    return out


def reject_unsupported(body: dict, name: str, allowed: tuple = (None,)) -> None:
    """Fail clearly on a known OpenAI field this server does not implement."""
    value = body.get(name)
    if value not in allowed and not (value == {} or value == []):
        raise invalid(f"'{name}' is not supported by this server.", name, code="unsupported_parameter")


def _check_range(name: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise invalid(f"Invalid value for '{name}': {value} is below the minimum of {lo}.", name)
    if hi is not None and value > hi:
        raise invalid(f"Invalid value for '{name}': {value} is above the maximum of {hi}.", name)
