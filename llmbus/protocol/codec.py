"""The one wire codec: typed dataclass records <-> MessagePack maps.

``encode(msg)`` writes a record as a map keyed by field name; ``decode(cls, data)`` reads it back,
checking every field against its annotation, and raises :class:`ProtocolError` (a ``ValueError``)
naming the record and field on any malformed payload. Records validate their own invariants in
``__post_init__``; a ``ValueError`` raised there also surfaces as a ``ProtocolError``.

NOTE: compatibility rule. New fields are appended *with defaults*; a decoder fills a missing field
from its default and ignores keys it does not know, so old and new services interoperate.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")


class ProtocolError(ValueError):
    """A payload that is not a valid encoding of the expected record."""


def encode(msg: Any) -> bytes:
    """Serialize a protocol record (a dataclass instance) to MessagePack bytes."""
    if not dataclasses.is_dataclass(msg) or isinstance(msg, type):
        raise TypeError(f"encode() takes a protocol record, got {type(msg).__name__}")
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def decode(cls: type[T], data: bytes | bytearray | memoryview) -> T:
    """Parse MessagePack bytes into a ``cls`` record; ``ProtocolError`` if malformed."""
    name = cls.__name__
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"{name}: payload is not valid MessagePack ({exc})") from None
    return _from_wire(cls, raw, name)


def from_raw(cls: type[T], raw: Any) -> T:
    """A ``cls`` record from an already unpacked MessagePack value (checked as ``decode`` checks);
    for readers that unpack a container once and check its items one by one."""
    return _from_wire(cls, raw, cls.__name__)


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _from_wire(cls: type[T], raw: Any, where: str) -> T:
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(raw).__name__}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            kwargs[f.name] = _check(hints[f.name], raw[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{where}: missing required field {f.name!r}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"{where}: {exc}") from None


def _check(tp: Any, value: Any, where: str) -> Any:
    """Return ``value`` converted to ``tp``, or raise ProtocolError naming ``where``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ProtocolError(f"{where}: must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(arg, value, where)
            except ProtocolError as exc:
                errors.append(str(exc))
        raise ProtocolError(errors[0] if len(errors) == 1 else f"{where}: no variant matched ({'; '.join(errors)})")
    if dataclasses.is_dataclass(tp):
        return _from_wire(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp) or (Any,)
        return [_check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list) or len(value) != len(args):
            raise ProtocolError(f"{where}: expected a list of {len(args)} items")
        return tuple(_check(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        return value  # free-form maps (engine state) are checked by their consumer
    if tp is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected a boolean, got {type(value).__name__}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer, got {type(value).__name__}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string, got {type(value).__name__}")
        return value
    if tp is bytes:
        if not isinstance(value, (bytes, bytearray)):
            raise ProtocolError(f"{where}: expected bytes, got {type(value).__name__}")
        return bytes(value)
    raise TypeError(f"{where}: unsupported annotation {tp!r}")  # a bug in a record definition
