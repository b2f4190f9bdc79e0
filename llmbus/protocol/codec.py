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
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from llmbus.protocol.messages import brief

T = TypeVar("T")


class ProtocolError(ValueError):
    """A payload that is not a valid encoding of the expected record. Its message is cut to
    ``MAX_ERROR_CHARS``: it may quote the payload."""

    def __init__(self, message: str) -> None:
        super().__init__(brief(message))


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
        # (some say nothing: FormatError for a reserved byte such as 0xc1)
        raise ProtocolError(f"{name}: payload is not valid MessagePack ({str(exc) or type(exc).__name__})") from None
    return _from_wire(cls, raw, name)


def from_raw(cls: type[T], raw: Any) -> T:
    """A ``cls`` record from an already unpacked MessagePack value (checked as ``decode`` checks);
    for readers that unpack a container once and check its items one by one."""
    return _from_wire(cls, raw, cls.__name__)


_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})


@functools.cache
def _field_names(cls: type) -> tuple[str, ...] | None:
    """The field names of record class ``cls``; None for anything else."""
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None


def _to_wire(value: Any) -> Any:
    cls = type(value)
    if cls in _SCALARS:
        return value
    names = _field_names(cls)
    if names is not None:
        return {name: _to_wire(getattr(value, name)) for name in names}
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


Checker = Callable[[Any, str], Any]


@functools.cache
def _plan(cls: type) -> tuple[tuple[str, Checker, bool], ...]:
    """Per field of record ``cls``: (name, its checker, required). Built once per class, so decoding
    a message does no annotation introspection (the token events a gateway reads every engine step
    spent most of their decoding time there)."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _built(hints[f.name]),
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls))


def _built(tp: Any) -> Checker:
    """``_checker(tp)``; an annotation it cannot even read (a bug in a record definition) fails
    when a payload carries that field, not every decode of the record."""
    try:
        return _checker(tp)
    except Exception as exc:
        error = exc  # NOTE: ``exc`` itself is unbound once the except clause ends

        def broken(value: Any, where: str) -> Any:
            raise error

        return broken


def _from_wire(cls: type[T], raw: Any, where: str) -> T:
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(raw).__name__}")
    kwargs = {}
    for name, check, required in _plan(cls):
        if name in raw:
            kwargs[name] = check(raw[name], f"{where}.{name}")
        elif required:
            raise ProtocolError(f"{where}: missing required field {name!r}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"{where}: {exc}") from None


def _got(value: Any) -> str:
    return type(value).__name__


def _expect(what: str, kinds: type | tuple[type, ...], *, bools: bool = True,
            convert: Callable[[Any], Any] | None = None) -> Checker:  # fmt: skip
    """A checker accepting instances of ``kinds`` (not bools unless ``bools``: bool is an int),
    returned as they are or through ``convert``."""

    def check(value: Any, where: str) -> Any:
        if isinstance(value, kinds) and (bools or value.__class__ is not bool):
            return value if convert is None else convert(value)
        raise ProtocolError(f"{where}: expected {what}, got {_got(value)}")

    return check


_MAP = _expect("a map", dict)
_SCALAR_CHECKERS: dict[type, Checker] = {
    bool: _expect("a boolean", bool),
    int: _expect("an integer", int, bools=False),
    float: _expect("a number", (int, float), bools=False, convert=float),
    str: _expect("a string", str),
    bytes: _expect("bytes", (bytes, bytearray), convert=bytes),
}


def _checker(tp: Any) -> Checker:
    """A function ``(value, where) -> value converted to tp``, raising ProtocolError naming ``where``.

    NOTE: not cached by annotation: ``int | float == float | int``, but the variants are tried in
    the order written; ``_plan`` caches per record class instead."""
    if tp is Any:
        return lambda value, where: value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        nullable = type(None) in args
        variants = [_checker(arg) for arg in args if arg is not type(None)]

        def union(value: Any, where: str) -> Any:
            if value is None:
                if nullable:
                    return None
                raise ProtocolError(f"{where}: must not be null")
            errors = []
            for check in variants:
                try:
                    return check(value, where)
                except ProtocolError as exc:
                    errors.append(str(exc))
            raise ProtocolError(errors[0] if len(errors) == 1 else f"{where}: no variant matched ({'; '.join(errors)})")

        return union
    if dataclasses.is_dataclass(tp):
        return lambda value, where: _from_wire(tp, value, where)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        check_item = _checker(item)

        def list_of(value: Any, where: str) -> list:
            if not isinstance(value, list):
                raise ProtocolError(f"{where}: expected a list, got {_got(value)}")
            if item is Any:
                return list(value)
            return [check_item(v, f"{where}[{i}]") for i, v in enumerate(value)]

        return list_of
    if origin is tuple:
        checks = [_checker(a) for a in typing.get_args(tp)]

        def tuple_of(value: Any, where: str) -> tuple:
            if not isinstance(value, list) or len(value) != len(checks):
                raise ProtocolError(f"{where}: expected a list of {len(checks)} items")
            return tuple(c(v, f"{where}[{i}]") for i, (c, v) in enumerate(zip(checks, value)))

        return tuple_of
    if origin is dict:
        return _MAP  # free-form maps (engine state) are checked by their consumer
    if tp in _SCALAR_CHECKERS:
        return _SCALAR_CHECKERS[tp]

    def unsupported(value: Any, where: str) -> Any:
        raise TypeError(f"{where}: unsupported annotation {tp!r}")  # a bug in a record definition

    return unsupported
