"""JSON output grammars: a JSON Schema (or "any JSON object") compiled to a byte-level matcher.

A guide spec is a canonical JSON string (``guide_spec``) naming what the output must be: a JSON
value matching ``schema`` (absent: any JSON object), optionally between a literal ``prefix`` and
``suffix`` (a tool call's ``<tool_call>`` tags). ``compile_guide`` turns it into a ``Grammar``
whose states are immutable and hashable, so what is computed for one state (the next state for a
byte, the tokens allowed there) is cached and shared by every request with the same spec.

The matcher is a set of stack machines ("threads"), one per way the output read so far can be
parsed; ``anyOf`` and type lists fork threads, a byte that a thread cannot take ends it. A state
with no threads left is a dead end; one with an empty thread has matched the whole grammar.

Generation must end, so the grammar is narrower than JSON itself in two ways a model does not
notice: whitespace between tokens is one space, or a line break and an indentation (at most
``MAX_INDENT`` spaces or ``MAX_TABS`` tabs), as compact and pretty-printed JSON have it; numbers
have at most ``MAX_NUMBER`` bytes. (Free whitespace lets a weak model spend its whole budget on
blank lines, never closing the value.)
Strings are checked as JSON strings of valid UTF-8 (escapes included), their decoded value against
a ``pattern`` (``llmbus.guide.regex``) or a known ``format`` (date, time, date-time, uuid, email,
ipv4); keys are the schema's properties, each at most once, in any order, every ``required`` one
before the object closes. Extra keys only where ``additionalProperties`` allows them, or the schema
lists no ``properties`` at all (as OpenAI's strict mode and xgrammar do: a schema that lists its
properties means those, and ``"properties": {}`` means an empty object). A number's bounds
(whole ones, where it is not an integer) become a pattern of its text. Validation keywords this
matcher cannot enforce (fractional bounds, ``uniqueItems``, ...) are refused with ``GuideError`` rather than ignored; annotations
(``title``, ``description``, ``default``, other formats, ...) are ignored.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field

from llmbus.guide.regex import Regex, RegexError, meets

MAX_INDENT = 40  # spaces after a line break (4 per level, 10 levels)
MAX_TABS = 10
MAX_NUMBER = 24  # bytes in one number
MAX_SPEC_BYTES = 64 * 1024  # a guide spec (the schema) as sent on the bus
MAX_NODES = 2048  # schema nodes after compilation ($refs count once)
MAX_UNION_DEPTH = 64  # choices ($ref, anyOf, allOf) directly within one another
MAX_CHOICES = 1024  # strings in a choice guide
MAX_THREADS = 256  # ways one output may be read at once (anyOf options alive): a byte needing more is refused

_WS = frozenset(b" \t\n\r")
# every byte a value's start, an object, an array or a number can take: whitespace, punctuation,
# digits and the letters of true/false/null (the rest of those is a literal frame's)
_STRUCTURAL = frozenset(b' \t\n\r{}[]:,"-+.eE0123456789tfn')
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_NOT_PLAIN = re.compile(r'["\\\x00-\x1f]')  # what a JSON string's body holds only escaped

# keywords that constrain values in ways this matcher does not enforce: refused, not ignored
_REFUSED = ("patternProperties", "multipleOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
            "dependencies", "propertyNames", "minProperties", "maxProperties", "uniqueItems", "contains",
            "minContains", "maxContains", "prefixItems", "unevaluatedProperties", "unevaluatedItems")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_FRACTION = 16  # digits after the point of a bounded number
MAX_DIGITS = 18  # an integer bounded on one side only is bounded here on the other
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# a calendar day: 31 days in seven months, 30 in four, February's 29th in leap years only
_DATE = (r"(\d{4}-((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)|02-(0[1-9]|1\d|2[0-8]))"
         r"|(\d\d(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)-02-29)")
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,9})?"
_OFFSET = r"(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# string formats enforced as patterns (RFC 3339 dates and times, ...); others are annotations
_FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}{_OFFSET}$",
    "date-time": f"^{_DATE}T{_TIME}{_OFFSET}$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "email": r"^[^\s@\\\"]+@[^\s@\\\"]+\.[^\s@\\\"]+$",
    "ipv4": f"^({_OCTET}\\.){{3}}{_OCTET}$",
}


class GuideError(ValueError):
    """A guide spec or schema this matcher cannot serve; the message says what and why."""


# -- schema nodes ---------------------------------------------------------------------------------
# NOTE: eq=False: nodes hash by identity, so a recursive schema ($ref to itself) is a finite graph


@dataclass(eq=False)
class ObjectNode:
    props: dict[bytes, object] = field(default_factory=dict)  # JSON-encoded key (no quotes) -> node
    required: frozenset = frozenset()
    extra: object | None = None  # node of additional properties' values; None: none allowed


@dataclass(eq=False)
class ArrayNode:
    items: object = None
    min_items: int = 0
    max_items: int | None = None


@dataclass(eq=False)
class StringNode:
    min_len: int = 0
    max_len: int | None = None
    pattern: Regex | None = None  # the decoded value must match it (searched, as JSON Schema says)


@dataclass(eq=False)
class NumberNode:
    integer: bool = False


@dataclass(eq=False)
class RangeNode:
    digits: Regex  # a number within bounds: its text, matched as a pattern


def _magnitudes(lo: int, hi: int, lo_in: bool, hi_in: bool, integer: bool) -> list[str]:
    """Alternatives for the non-negative decimals from lo to hi (whole numbers; each end in or
    out), integers only or with a fraction."""
    if integer:
        lo, hi = lo + (not lo_in), hi - (not hi_in)
        return _digit_ranges(lo, hi) if lo <= hi else []
    frac = rf"\.\d{{1,{MAX_FRACTION}}}"
    out = []
    first = lo if lo_in else lo + 1  # whole parts whose every fraction lies within
    if first <= hi - 1:
        out.append(f"(?:{'|'.join(_digit_ranges(first, hi - 1))})(?:{frac})?")
    if not lo_in and lo < hi:  # lo itself only with a fraction above zero
        out.append(rf"{lo}\.\d{{0,{MAX_FRACTION - 1}}}[1-9]\d{{0,{MAX_FRACTION - 1}}}")
    if hi_in and (lo < hi or lo_in):  # hi itself only with a fraction of zeros
        out.append(rf"{hi}(?:\.0{{1,{MAX_FRACTION}}})?")
    return out


def _digit_ranges(lo: int, hi: int) -> list[str]:
    """Regex alternatives matching exactly the decimal integers lo..hi (0 <= lo <= hi), no leading zeros."""
    out = []
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), min(hi, 10**n - 1)
        if a <= b:
            out += _same_length(str(a), str(b))
    return out


def _same_length(a: str, b: str) -> list[str]:
    """Alternatives for the digit strings a..b, both of one length."""
    if a == b:
        return [a]
    i = 0
    while a[i] == b[i]:
        i += 1
    head, a, b = a[:i], a[i:], b[i:]
    n = len(a) - 1  # digits after the first that differs
    rest = r"\d" * n
    if a[1:] == "0" * n and b[1:] == "9" * n:
        return [f"{head}[{a[0]}-{b[0]}]{rest}"]
    out, first, last = [], a[0], b[0]
    if a[1:] != "0" * n:  # a's block, from a up
        out += [head + a[0] + x for x in _same_length(a[1:], "9" * n)]
        first = chr(ord(a[0]) + 1)
    tail = []
    if b[1:] != "9" * n:  # b's block, up to b
        tail = [head + b[0] + x for x in _same_length("0" * n, b[1:])]
        last = chr(ord(b[0]) - 1)
    if first <= last:
        out.append(f"{head}[{first}-{last}]{rest}")
    return out + tail


@dataclass(eq=False)
class LiteralNode:
    options: tuple[bytes, ...] = ()  # exact JSON texts (enum, const, true/false/null)


@dataclass(eq=False)
class UnionNode:
    options: tuple = ()


def any_value() -> UnionNode:
    """Any JSON value (its objects take any keys, its arrays any items)."""
    node = UnionNode()
    node.options = (ObjectNode(extra=node), ArrayNode(items=node), StringNode(), NumberNode(),
                    LiteralNode((b"true", b"false", b"null")))  # fmt: skip
    return node


def _dump(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


# the keywords this matcher enforces (any other is refused, _REFUSED, or says nothing of the value:
# title, description, default, OpenAPI's nullable, ...)
_CONSTRAINING = frozenset(("type", "enum", "const", "properties", "required", "additionalProperties", "items",
                           "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "minimum",
                           "maximum", "exclusiveMinimum", "exclusiveMaximum", "anyOf", "oneOf", "allOf", "$ref"))


def _no_siblings(schema: dict, key: str, where: str, allowed: tuple = ()) -> None:
    """Refuse the keywords beside ``key`` that would otherwise go unenforced."""
    beside = [k for k in schema if k != key and k in _CONSTRAINING and k not in allowed]
    if beside:
        raise GuideError(f"{where}: '{beside[0]}' beside '{key}' is not supported in guided JSON (it would not be "
                         f"enforced); put it inside the {'referenced schema' if key == '$ref' else 'subschemas'}")


def _merged(rest: dict, option, where: str) -> dict:
    """``option`` with the keywords ``rest`` of the schema around it, when both can hold at once
    as one schema: keys of one side only, equal values, or ``required`` lists (joined). Otherwise a
    GuideError: the two would need checking apart, which one matcher cannot do."""
    if not rest:
        return option
    if option is True or option == {}:
        return dict(rest)
    if not isinstance(option, dict):
        raise GuideError(f"{where}: a schema must be an object, got {type(option).__name__}")
    out = dict(option)
    for k, v in rest.items():
        if k == "required" and k in out and isinstance(v, list) and isinstance(out[k], list):
            out[k] = list(dict.fromkeys(out[k] + v))
        elif k in out and out[k] != v:
            raise GuideError(f"{where}: '{k}' both beside and inside it is not supported in guided JSON")
        else:
            out[k] = v
    # NOTE: additionalProperties counts only the properties of its own schema: merged across, it
    # would allow what one side forbids
    sides = (rest, option)
    if any("additionalProperties" in a and "properties" in b and "properties" not in a for a, b in (sides, sides[::-1])):
        raise GuideError(f"{where}: 'additionalProperties' and 'properties' on different sides of it are not "
                         "supported in guided JSON")
    return out


def _kinds(schema: dict) -> list:
    """A schema's ``type`` as a list (one name, or a list of them; [None] when it has none)."""
    kind = schema.get("type")
    return kind if isinstance(kind, list) else [kind]


def _is_type(value, kind) -> bool:
    """Whether a JSON value is of JSON Schema type ``kind``."""
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    return {"null": value is None, "boolean": isinstance(value, bool), "string": isinstance(value, str),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "object": isinstance(value, dict), "array": isinstance(value, list)}.get(kind, False)  # fmt: skip


class _Compiler:
    def __init__(self, root: dict) -> None:
        self.root = root
        self.refs: dict[str, object] = {}
        self.nodes = 0
        self.shared: dict[str, object] = {}

    def node(self, schema, where: str):
        """The node of ``schema``; equal subschemas share one (so ``anyOf`` copies of one schema
        fork no extra threads: equal threads are one in a state's set)."""
        try:
            key = json.dumps(schema, sort_keys=True)
        except (TypeError, ValueError):
            key = None
        if key is not None and key in self.shared:
            return self.shared[key]
        node = self.build(schema, where)
        if key is not None:
            self.shared[key] = node
        return node

    def build(self, schema, where: str):
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise GuideError(f"the schema is too large: more than {MAX_NODES} subschemas")
        if schema is True or schema == {}:
            return any_value()
        if not isinstance(schema, dict):
            raise GuideError(f"{where}: a schema must be an object, got {type(schema).__name__}")
        for key in _REFUSED:
            if key in schema:
                raise GuideError(f"{where}: '{key}' is not supported in guided JSON (it cannot be enforced "
                                 "while decoding); remove it or check the value after generation")
        if "$ref" in schema:
            _no_siblings(schema, "$ref", where)
            return self.ref(schema["$ref"], where)
        for key in ("const", "enum"):
            if key in schema:
                values = [schema["const"]] if key == "const" else schema["enum"]
                if not isinstance(values, list) or not values:
                    raise GuideError(f"{where}: 'enum' must be a non-empty array")
                _no_siblings(schema, key, where, allowed=("type",))
                if "type" in schema:  # the values of the types allowed
                    values = [v for v in values if any(_is_type(v, k) for k in _kinds(schema))]
                    if not values:
                        raise GuideError(f"{where}: no value of '{key}' is of type {schema['type']!r}")
                return LiteralNode(tuple(dict.fromkeys(self.literal(v, where) for v in values)))
        for key in ("anyOf", "oneOf", "allOf"):  # NOTE: oneOf as anyOf: exclusivity is not enforced
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise GuideError(f"{where}: '{key}' must be a non-empty array")
                if key == "allOf" and len(options) != 1:
                    raise GuideError(f"{where}: 'allOf' is supported with exactly one subschema")
                # the keywords beside it hold for every option: each option is merged with them
                rest = {k: v for k, v in schema.items() if k != key and k in _CONSTRAINING}
                options = [_merged(rest, o, f"{where}.{key}[{i}]") for i, o in enumerate(options)]
                if key == "allOf":
                    return self.node(options[0], f"{where}.allOf[0]")
                return UnionNode(tuple(self.node(o, f"{where}.{key}[{i}]") for i, o in enumerate(options)))
        bounds = [k for k in _BOUNDS if k in schema]
        if bounds and not {"integer", "number"} & set(_kinds(schema)):  # (["integer", "null"]: bounds the integers)
            raise GuideError(f"{where}: '{bounds[0]}' is supported with type 'integer' or 'number' only")
        kind = schema.get("type")
        if kind is None:
            kind = ("object" if "properties" in schema or "additionalProperties" in schema
                    else "array" if "items" in schema else None)  # fmt: skip
            if kind is None:
                return any_value()
        if isinstance(kind, list):
            if not kind:
                raise GuideError(f"{where}: 'type' must not be an empty array")
            return UnionNode(tuple(self.typed(schema, k, where) for k in dict.fromkeys(kind)))
        return self.typed(schema, kind, where)

    def typed(self, schema: dict, kind, where: str):
        if kind not in _TYPES:
            raise GuideError(f"{where}: unknown type {kind!r} (one of {', '.join(_TYPES)})")
        if kind == "object":
            return self.object(schema, where)
        if kind == "array":
            lo, hi = self.bounds(schema, "minItems", "maxItems", where)
            node = ArrayNode(min_items=lo, max_items=hi)
            items = schema.get("items", True)
            node.items = self.node(items, f"{where}.items")
            return node
        if kind == "string":
            lo, hi = self.bounds(schema, "minLength", "maxLength", where)
            pattern = schema.get("pattern", _FORMATS.get(schema.get("format")))
            if pattern is None:
                return StringNode(lo, hi)
            if not isinstance(pattern, str):
                raise GuideError(f"{where}: 'pattern' must be a string")
            try:
                return StringNode(lo, hi, Regex(pattern))
            except RegexError as exc:
                raise GuideError(f"{where}: {exc}") from None
        if kind in ("integer", "number") and any(k in schema for k in _BOUNDS):
            return self.number_range(schema, kind == "integer", where)
        if kind in ("number", "integer"):
            return NumberNode(integer=kind == "integer")
        if kind == "boolean":
            return LiteralNode((b"true", b"false"))
        return LiteralNode((b"null",))

    def object(self, schema: dict, where: str) -> ObjectNode:
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise GuideError(f"{where}: 'properties' must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise GuideError(f"{where}: 'required' must be an array of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise GuideError(f"{where}: required properties {missing} are not in 'properties'")
        node = ObjectNode(required=frozenset(_dump(r)[1:-1] for r in required))
        node.props = {_dump(k)[1:-1]: self.node(v, f"{where}.properties.{k}") for k, v in props.items()}
        # NOTE: a schema that lists properties (even none: a tool without parameters) means those only
        extra = schema.get("additionalProperties", "properties" not in schema)
        if extra is not False:
            node.extra = self.node(extra, f"{where}.additionalProperties")
        return node

    @staticmethod
    def number_range(schema: dict, integer: bool, where: str) -> "RangeNode":
        """A number within minimum/maximum (exclusive ones too) as a pattern of its text: for an
        integer any bounds, for other numbers whole-number bounds (a price >= 0, a share in
        [0, 1]), decimals without an exponent, at most MAX_FRACTION digits after the point."""
        most = 10**MAX_DIGITS - 1
        lo, hi, lo_in, hi_in = -most, most, True, True
        for key in _BOUNDS:
            value = schema.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise GuideError(f"{where}: '{key}' must be a number")
            if not integer and value != int(value):
                raise GuideError(f"{where}: '{key}' on a number must be a whole number ({value} is not): "
                                 "other bounds cannot be enforced while decoding")
            inclusive = not key.startswith("exclusive")
            if integer:  # NOTE: an integer's bounds are whole and inclusive
                value, inclusive = (math.ceil(value) if inclusive else math.floor(value) + 1) if "inimum" in key \
                    else (math.floor(value) if inclusive else math.ceil(value) - 1), True
            value = int(value)
            if "inimum" in key and (value > lo or (value == lo and not inclusive)):
                lo, lo_in = value, inclusive
            elif "aximum" in key and (value < hi or (value == hi and not inclusive)):
                hi, hi_in = value, inclusive
        if lo > hi or (lo == hi and not (lo_in and hi_in)):
            raise GuideError(f"{where}: no {'integer' if integer else 'number'} lies within its minimum and maximum")
        options = []
        if lo < 0:  # -y for y in (max(-hi, 0), -lo], the ends as the bounds have them
            least, least_in = (-hi, hi_in) if hi < 0 else (0, False)
            options += ["-(?:" + "|".join(_magnitudes(least, -lo, least_in, lo_in, integer)) + ")"]
        if hi >= 0:
            options += _magnitudes(max(lo, 0), hi, lo_in if lo >= 0 else True, hi_in, integer)
        return RangeNode(Regex("^(?:" + "|".join(options) + ")$"))

    @staticmethod
    def bounds(schema: dict, lo_key: str, hi_key: str, where: str) -> tuple[int, int | None]:
        lo, hi = schema.get(lo_key, 0), schema.get(hi_key)
        for key, v in ((lo_key, lo), (hi_key, hi)):
            if v is not None and (type(v) is not int or v < 0):
                raise GuideError(f"{where}: '{key}' must be an integer >= 0")
        if hi is not None and hi < lo:
            raise GuideError(f"{where}: '{hi_key}' ({hi}) is below '{lo_key}' ({lo})")
        return lo, hi

    @staticmethod
    def literal(value, where: str) -> bytes:
        try:
            return _dump(value)
        except (TypeError, ValueError) as exc:
            raise GuideError(f"{where}: {exc}") from None

    def ref(self, ref, where: str):
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise GuideError(f"{where}: only local references ('#/$defs/Name') are supported, got {ref!r}")
        if ref in self.refs:
            return self.refs[ref]
        target = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise GuideError(f"{where}: reference {ref!r} names nothing in the schema")
            target = target[part]
        # NOTE: a placeholder first, so a schema that refers to itself compiles to a cycle
        holder = UnionNode()
        self.refs[ref] = holder
        holder.options = (self.node(target, ref),)
        return holder


# -- the matcher ----------------------------------------------------------------------------------
# A thread is a tuple of frames, the innermost last. Frames:
#   ("V", node, ws)                  a value of ``node`` is next (ws: the whitespace run so far)
#   ("O", node, phase, seen, key, ws) inside an object
#   ("K", partial, esc, utf8)        inside a key; partial: the bytes so far while they begin a
#                                    declared property's name, else None
#   ("A", node, phase, count, ws)    inside an array
#   ("S", node, length, esc, utf8, acc, nfa)  inside a string; length in characters (kept only
#                                    as far as the bounds need, so an unbounded string's state
#                                    never changes); with a pattern, nfa: its states after the
#                                    characters so far, acc: the code point being read
#   ("N", node, phase, length)       inside a number
#   ("R", node, nfa)                 inside an integer within bounds: its pattern's states
#   ("L", options, pos)              inside a literal: options share their first ``pos`` bytes
# esc: 0, 1 after a backslash, 2..5 reading \u's hex digits; 13 after a first digit D, 14..15 in a
# surrogate pair's first half, 30..35 its second half (\uDC00-\uDFFF, which must follow): the pair
# is one character, as JSON Schema's lengths count it, and neither half stands alone;
# utf8: continuation bytes still due (utf8 % 10; see _SECOND).

_OPEN, _COLON, _AFTER, _NEXT, _VALUE = range(5)
# number phases; the _END ones may end the number
_SIGN, _ZERO, _INT, _DOT, _FRAC, _EXP, _EXPSIGN, _EXPD = range(8)
_NUM_END = frozenset((_ZERO, _INT, _FRAC, _EXPD))
_NUM_DUE = {_SIGN: 1, _DOT: 1, _EXP: 1, _EXPSIGN: 1}  # bytes a phase needs before the number may end


# UTF-8 continuation bytes due (utf8 % 10), where the second byte's range is narrower (no overlong
# forms, no surrogates, nothing past U+10FFFF): after E0, ED, F0, F4
_SECOND = {12: (0xA0, 0xBF), 22: (0x80, 0x9F), 13: (0x90, 0xBF), 23: (0x80, 0x8F)}


def _string_byte(esc: int, utf8: int, b: int):
    """(esc, utf8, whether a character just ended) after byte ``b`` inside a string (not an
    unescaped quote), or None where ``b`` cannot come next."""
    if esc == 1:
        if b in b'"\\/bfnrt':
            return 0, 0, True
        return (2, 0, False) if b == ord("u") else None
    if esc == 30:  # a surrogate pair's first half read: its second is due
        return (31, 0, False) if b == _BACKSLASH else None
    if esc == 31:
        return (32, 0, False) if b == ord("u") else None
    if esc:
        if b not in _HEX:
            return None
        if esc == 2:
            return (13 if b in b"dD" else 3), 0, False
        if esc == 13:  # \uD8xx-\uDBxx opens a pair; \uDCxx-\uDFxx alone is no character
            return None if b in b"cdefCDEF" else ((14 if b in b"89abAB" else 4), 0, False)
        if esc == 32:
            return (33, 0, False) if b in b"dD" else None
        if esc == 33:
            return (34, 0, False) if b in b"cdefCDEF" else None
        if esc in (5, 35):
            return 0, 0, True
        return (30 if esc == 15 else esc + 1), 0, False
    if not utf8:
        if b == _BACKSLASH:
            return 1, 0, False
        if b < 0x20:
            return None
    step = _utf8_byte(utf8, b)
    return None if step is None else (0, *step)


def _utf8_byte(utf8: int, b: int) -> tuple[int, bool] | None:
    """(utf8, whether a character just ended) after byte ``b`` of UTF-8 text, or None where ``b``
    cannot come next (no overlong forms, no surrogates, nothing past U+10FFFF)."""
    if utf8:
        lo, hi = _SECOND.get(utf8, (0x80, 0xBF))
        due = utf8 % 10
        return (due - 1, due == 1) if lo <= b <= hi else None
    if b < 0x80:
        return 0, True
    if 0xC2 <= b <= 0xDF:
        return 1, False
    if 0xE0 <= b <= 0xEF:
        return (12 if b == 0xE0 else 22 if b == 0xED else 2), False
    if 0xF0 <= b <= 0xF4:
        return (13 if b == 0xF0 else 23 if b == 0xF4 else 3), False
    return None


# whitespace run states: -1 none allowed (before the guided value), 0 none yet, 1 one space or
# tab (the run is over), 2 after \r (\n due), 3 after a line break, 4.. that many - 3 spaces of
# indentation, 100.. that many - 100 tabs
def _space(ws: int, b: int) -> int | None:
    """The whitespace run's state after whitespace byte ``b``, or None where the run cannot go on."""
    if ws <= 0:
        return None if ws else 1 if b in b" \t" else 3 if b == ord("\n") else 2
    if ws == 2:
        return 3 if b == ord("\n") else None
    if ws == 3:
        return 4 if b == ord(" ") else 101 if b == ord("\t") else None
    if 4 <= ws < 3 + MAX_INDENT and b == ord(" "):
        return ws + 1
    if 100 < ws < 100 + MAX_TABS and b == ord("\t"):
        return ws + 1
    return None


_UNESCAPE = {ord('"'): 34, ord("\\"): 92, ord("/"): 47, ord("b"): 8, ord("f"): 12, ord("n"): 10, ord("r"): 13,
             ord("t"): 9}  # fmt: skip


def _code_point(esc: int, utf8: int, acc: int, b: int) -> tuple[int, int | None]:
    """(the code point read so far, the character's code point where ``b`` completes one) for
    byte ``b`` of a string, ``esc``/``utf8`` as before it (``_string_byte`` has checked it). In a
    surrogate pair the first half waits in ``acc``'s high bits for the second."""
    if esc == 1:
        return 0, (None if b == ord("u") else _UNESCAPE[b])
    if esc in (30, 31):
        return acc, None
    if esc:
        h = int(chr(b), 16)
        if esc == 15:
            return (acc * 16 + h) << 16, None
        if esc >= 32:
            low = (acc & 0xFFFF) * 16 + h
            if esc < 35:
                return (acc & ~0xFFFF) | low, None
            return 0, 0x10000 + (((acc >> 16) - 0xD800) << 10) + (low - 0xDC00)
        return (0, acc * 16 + h) if esc == 5 else (acc * 16 + h, None)
    if utf8:
        acc = (acc << 6) | (b & 0x3F)
        return (0, acc) if utf8 % 10 == 1 else (acc, None)
    if b == _BACKSLASH:
        return 0, None
    if b < 0x80:
        return 0, b
    return b & (0x1F if b < 0xE0 else 0x0F if b < 0xF0 else 0x07), None


_LEAST = {1: 0x80, 2: 0x800, 3: 0x10000}  # the least code point of a UTF-8 sequence, by bytes after the first
_HEX_BITS = {3: 12, 4: 8, 5: 4}  # \u digits still due, as bits


def _due_range(esc: int, utf8: int, acc: int) -> tuple[int, int] | None:
    """The code points the character being read can still become (None: between characters)."""
    if utf8:  # NOTE: within U+10FFFF (an F4 lead byte's bits reach 0x13FFFF)
        bits = 6 * (utf8 % 10)
        return max(acc << bits, _LEAST[utf8 % 10]), min(((acc + 1) << bits) - 1, 0x10FFFF)
    if esc in _HEX_BITS:
        bits = _HEX_BITS[esc]
        return acc << bits, ((acc + 1) << bits) - 1
    if esc in (1, 2):
        return 0, 0x10FFFF
    if esc == 13:
        return 0xD000, 0x10FFFF
    return (0x10000, 0x10FFFF) if esc else None


def _next_char(rx: Regex, nfa: frozenset, acc: int, cp: int | None, esc: int, utf8: int) -> frozenset | None:
    """A pattern's states after one more byte of a character: ``cp`` the code point the byte
    completes, else None (``acc`` the bits read so far, ``esc``/``utf8`` as after the byte). None
    where no character the one being read can still become fits: not even its first byte."""
    if cp is not None:
        return rx.step(nfa, cp)
    span = _due_range(esc, utf8, acc)
    return nfa if span is None or rx.can_take(nfa, *span) else None


def _starts(cset, b: int) -> bool:
    """Whether byte ``b`` can begin the UTF-8 of a character of ``cset``."""
    step = _utf8_byte(0, b)
    if step is None:
        return False
    acc, cp = _code_point(0, 0, 0, b) if b != _BACKSLASH else (0, b)
    return meets(cset, cp, cp) if cp is not None else meets(cset, *_due_range(0, step[0], acc))


def _done(rest: tuple) -> tuple:
    """The thread once the value on top of ``rest`` has ended: an enclosing object or array
    expects a separator next."""
    if not rest:
        return rest
    parent = rest[-1]
    if parent[0] == "O":
        return rest[:-1] + (("O", parent[1], _AFTER, parent[3], None, 0),)
    if parent[0] == "A":
        return rest[:-1] + (("A", parent[1], _AFTER, parent[3], 0),)
    return rest


def _literal(rest: tuple, options: tuple[bytes, ...], pos: int) -> list[tuple]:
    out = []
    if any(len(o) == pos for o in options):
        out.append(_done(rest))
    longer = tuple(o for o in options if len(o) > pos)
    if longer:
        out.append(rest + (("L", longer, pos),))
    return out


def _start(rest: tuple, node, ws: int, b: int) -> list[tuple]:
    """Threads after byte ``b`` where a value of ``node`` is due."""
    if b in _WS:
        ws = _space(ws, b)
        return [] if ws is None else [rest + (("V", node, ws),)]
    if ws == 2:  # a lone \r
        return []
    kind = type(node)
    if kind is UnionNode:
        return [t for option in node.options for t in _start(rest, option, ws, b)]
    if kind is ObjectNode:
        return [rest + (("O", node, _OPEN, frozenset(), None, 0),)] if b == ord("{") else []
    if kind is ArrayNode:
        return [rest + (("A", node, _OPEN, 0, 0),)] if b == ord("[") else []
    if kind is StringNode:
        nfa = node.pattern.initial if node.pattern is not None else None
        return [rest + (("S", node, 0, 0, 0, 0, nfa),)] if b == _QUOTE else []
    if kind is RangeNode:
        nfa = node.digits.step(node.digits.initial, b)
        return [] if nfa is None else [rest + (("R", node, nfa),)]
    if kind is NumberNode:
        if b == ord("-"):
            return [rest + (("N", node, _SIGN, 1),)]
        if b in _DIGITS:
            return [rest + (("N", node, _ZERO if b == ord("0") else _INT, 1),)]
        return []
    options = tuple(o for o in node.options if o[0] == b)
    return _literal(rest, options, 1) if options else []


def _feed(thread: tuple, b: int) -> list[tuple]:
    """Every thread that ``thread`` becomes after byte ``b`` (none: ``b`` cannot come next)."""
    if not thread:
        return []
    top, rest = thread[-1], thread[:-1]
    kind = top[0]
    if kind == "V":
        return _start(rest, top[1], top[2], b)
    if kind == "S":
        _, node, length, esc, utf8, acc, nfa = top
        if b == _QUOTE and not esc and not utf8:
            if length < node.min_len or (nfa is not None and not node.pattern.accepts(nfa)):
                return []
            return [_done(rest)]
        if not esc and not utf8 and node.max_len is not None and length >= node.max_len:
            return []
        step = _string_byte(esc, utf8, b)
        if step is None:
            return []
        if nfa is not None:
            acc, cp = _code_point(esc, utf8, acc, b)
            if (nfa := _next_char(node.pattern, nfa, acc, cp, step[0], step[1])) is None:
                return []
        esc, utf8, ended = step
        if ended:
            length += 1
            if node.max_len is None:
                length = min(length, node.min_len)
        return [rest + (("S", node, length, esc, utf8, acc, nfa),)]
    if kind == "N":
        return _number(rest, top, b)
    if kind == "L":
        _, options, pos = top
        options = tuple(o for o in options if o[pos] == b)
        return _literal(rest, options, pos + 1) if options else []
    if kind == "O":
        return _object(rest, top, b)
    if kind == "K":
        return _key(rest, top, b)
    if kind == "X":
        return _raw(rest, top, b)
    if kind == "R":  # go on, or (where the digits may end) hand the byte to the enclosing value
        _, node, nfa = top
        nxt = node.digits.step(nfa, b)
        out = [] if nxt is None else [rest + (("R", node, nxt),)]
        return out + _feed(_done(rest), b) if node.digits.accepts(nfa) else out
    return _array(rest, top, b)


_NUMBER_STEPS = {
    (_SIGN, "0"): _ZERO, (_SIGN, "d"): _INT,
    (_ZERO, "."): _DOT, (_ZERO, "e"): _EXP,
    (_INT, "d"): _INT, (_INT, "0"): _INT, (_INT, "."): _DOT, (_INT, "e"): _EXP,
    (_DOT, "d"): _FRAC, (_DOT, "0"): _FRAC,
    (_FRAC, "d"): _FRAC, (_FRAC, "0"): _FRAC, (_FRAC, "e"): _EXP,
    (_EXP, "+"): _EXPSIGN, (_EXP, "d"): _EXPD, (_EXP, "0"): _EXPD,
    (_EXPSIGN, "d"): _EXPD, (_EXPSIGN, "0"): _EXPD,
    (_EXPD, "d"): _EXPD, (_EXPD, "0"): _EXPD,
}  # fmt: skip
_NUMBER_CLASS = {**{d: "d" for d in b"123456789"}, ord("0"): "0", ord("."): ".", ord("e"): "e", ord("E"): "e",
                 ord("+"): "+", ord("-"): "+"}  # fmt: skip


def _number(rest: tuple, top: tuple, b: int) -> list[tuple]:
    _, node, phase, length = top
    cls = _NUMBER_CLASS.get(b)
    nxt = _NUMBER_STEPS.get((phase, cls)) if cls is not None else None
    if nxt is not None and node.integer and nxt in (_DOT, _EXP):
        nxt = None
    if nxt is not None:  # NOTE: room left for the digits a phase still needs, or it is a dead end
        return [rest + (("N", node, nxt, length + 1),)] if length + 1 + _NUM_DUE.get(nxt, 0) <= MAX_NUMBER else []
    if phase in _NUM_END:  # the number has ended: the byte is the enclosing value's
        return _feed(_done(rest), b)
    return []


def _raw(rest: tuple, top: tuple, b: int) -> list[tuple]:
    """Plain text matched whole by a regex (vLLM's guided_regex): valid UTF-8, each character
    stepping the NFA; where it matches, what follows (a suffix) may start."""
    _, rx, nfa, utf8, acc = top
    out = _feed(rest, b) if not utf8 and rx.accepts(nfa) and rest else []
    step = _utf8_byte(utf8, b)
    if step is None:
        return out
    acc, cp = (0, b) if b == _BACKSLASH else _code_point(0, utf8, acc, b)  # NOTE: no escapes in plain text
    nxt = _next_char(rx, nfa, acc, cp, 0, step[0])
    return out + ([rest + (("X", rx, nxt, step[0], acc),)] if nxt is not None else [])


def _has_keys(node: ObjectNode, seen: frozenset) -> bool:
    return node.extra is not None or len(seen) < len(node.props)


def _object(rest: tuple, top: tuple, b: int) -> list[tuple]:
    _, node, phase, seen, key, ws = top
    if b in _WS:
        ws = _space(ws, b)
        return [] if ws is None else [rest + (("O", node, phase, seen, key, ws),)]
    if ws == 2:  # a lone \r
        return []
    if phase in (_OPEN, _NEXT) and b == _QUOTE and _has_keys(node, seen):
        return [rest + (("O", node, phase, seen, None, 0), ("K", b"", 0, 0))]
    if phase in (_OPEN, _AFTER) and b == ord("}") and node.required <= seen:
        return [_done(rest)]
    if phase == _AFTER and b == ord(",") and _has_keys(node, seen):
        return [rest + (("O", node, _NEXT, seen, None, 0),)]
    if phase == _COLON and b == ord(":"):
        value = node.extra if key is None else node.props[key]
        seen = seen if key is None else seen | {key}
        return [rest + (("O", node, _VALUE, seen, None, 0), ("V", value, 0))]
    return []


def _key(rest: tuple, top: tuple, b: int) -> list[tuple]:
    """A key's byte. ``partial``: the key so far while it may still be a declared name (seen or
    not), else None. A declared name is taken once, with its own schema: never again, nor as an
    additional property with theirs (a duplicate a parser would read as the last one)."""
    _, partial, esc, utf8 = top
    parent = rest[-1]
    node, seen = parent[1], parent[3]
    if b == _QUOTE and not esc and not utf8:
        if partial is not None and partial in node.props:
            if partial in seen:
                return []
            name = partial
        elif node.extra is not None:
            name = None
        else:
            return []
        return [rest[:-1] + (("O", node, _COLON, seen, name, 0),)]
    # NOTE: no escapes in the keys of an object with both declared names and additional properties:
    # an escaped spelling ("\u0061") of a declared name would pass as another key
    if b == _BACKSLASH and not esc and node.props and node.extra is not None:
        return []
    step = _string_byte(esc, utf8, b)
    if step is None:
        return []
    if partial is not None:
        partial += bytes((b,))
        if not any(name.startswith(partial) for name in node.props):
            partial = None
    if node.extra is None and (partial is None or not any(
            name.startswith(partial) for name in node.props if name not in seen)):  # fmt: skip
        return []
    return [rest + (("K", partial, step[0], step[1]),)]


def _array(rest: tuple, top: tuple, b: int) -> list[tuple]:
    _, node, phase, count, ws = top
    if b in _WS:
        ws = _space(ws, b)
        return [] if ws is None else [rest + (("A", node, phase, count, ws),)]
    if ws == 2:  # a lone \r
        return []
    if phase in (_OPEN, _AFTER) and b == ord("]"):
        return [_done(rest)] if count >= node.min_items and (phase == _AFTER or count == 0) else []
    if phase == _AFTER:
        if b == ord(",") and (node.max_items is None or count < node.max_items):
            return [rest + (("A", node, _NEXT, count, 0),)]
        return []
    if node.max_items is not None and count >= node.max_items:
        return []
    return _start(rest + (("A", node, _VALUE, count + 1, 0),), node.items, 0, b)


def _can_end(thread: tuple) -> bool:
    if not thread:
        return True
    top = thread[-1]
    if top[0] == "X":
        return not top[3] and top[1].accepts(top[2]) and _can_end(thread[:-1])
    ended = top[2] in _NUM_END if top[0] == "N" else top[0] == "R" and top[1].digits.accepts(top[2])
    return ended and _can_end(_done(thread[:-1]))


class Grammar:
    """A compiled guide: ``initial`` state, ``step`` one byte, ``accepts`` a finished output.

    States are frozensets of threads; ``step`` returns None for a byte that cannot come next.
    Steps are memoized (bounded): generation revisits the same few states again and again.
    """

    MAX_MEMO = 1 << 18

    def __init__(self, root, prefix: bytes = b"", suffix: bytes = b"") -> None:
        """``root``: a schema node (a JSON value), a tuple of byte strings (the output is
        exactly one of them, as text) or a Regex (the output, as text, matches it whole)."""
        thread: tuple = (("L", (suffix,), 0),) if suffix else ()
        if isinstance(root, tuple):
            thread += (("L", root, 0),)
        elif isinstance(root, Regex):
            thread += (("X", root, root.initial, 0, 0),)
        else:
            thread += (("V", root, -1),)  # NOTE: -1: no whitespace before the value itself
        if prefix:
            thread += (("L", (prefix,), 0),)
        self.initial = frozenset((thread,))
        self._memo: dict = {}

    def step(self, state: frozenset, b: int) -> frozenset | None:
        key = (state, b)
        nxt = self._memo.get(key, False)
        if nxt is False:
            nxt = frozenset(t for thread in state for t in _feed(thread, b)) or None
            if nxt is not None and len(nxt) > MAX_THREADS:  # NOTE: a pathological schema's reading is refused
                nxt = None
            if len(self._memo) >= self.MAX_MEMO:
                self._memo.clear()
            self._memo[key] = nxt
        return nxt

    def advance(self, state: frozenset | None, data: bytes) -> frozenset | None:
        for b in data:
            if state is None:
                return None
            state = self.step(state, b)
        return state

    @staticmethod
    def digit_room(state: frozenset) -> int | None:
        """Where every thread is in a number's digits (a digit keeps it there): how many more
        digits the longest may take; else None."""
        room = None
        for thread in state:
            top = thread[-1] if thread else None
            if top is None or top[0] != "N" or top[2] not in (_INT, _FRAC, _EXPD):
                return None
            room = max(room or 0, MAX_NUMBER - top[3])
        return room

    @staticmethod
    def possible_bytes(state: frozenset) -> frozenset | None:
        """A superset of the bytes ``state`` can take next where that is cheap to know (every
        thread between values, in an object, array or number, or in a key of an object without
        extra keys), else None (any byte may)."""
        keys = None
        for thread in state:
            if not thread:
                continue
            top = thread[-1]
            if top[0] == "K":
                node, partial = thread[-2][1], top[1]
                if node.extra is not None or partial is None or top[2] or top[3]:
                    return None
                keys = (keys or set()) | {name[len(partial)] for name in node.props if len(name) > len(partial)
                                          and name.startswith(partial)}  # fmt: skip
            elif top[0] not in "VOANR":
                return None
        if keys is None:
            return _STRUCTURAL
        return _STRUCTURAL | keys

    def accepts(self, state: frozenset | None) -> bool:
        return state is not None and any(_can_end(t) for t in state)

    def matches(self, data: bytes) -> bool:
        """Whether ``data`` is a whole output this grammar allows."""
        return self.accepts(self.advance(self.initial, data))

    def in_run(self, state: frozenset) -> tuple | None:
        """Where ``state`` is one thread between characters of a pattern (a JSON string's without
        length bounds left to check, or a regex guide's text), at a place in a counted run of one
        set (``Regex.in_run``): (whether the text is a JSON string's, the set, characters the run may
        still take, characters due before it may end, the state once it has ended); else None.
        There a token's fate hangs on how many of its first characters are in the set (the run
        cannot end before a character of the set, so it ends at the first other one), so masks
        need no walk (``llmbus.guide.runs``)."""
        key = (state, "run")
        hit = self._memo.get(key, False)
        if hit is False:
            hit = self._in_run(state)
            if len(self._memo) >= self.MAX_MEMO:
                self._memo.clear()
            self._memo[key] = hit
        return hit

    @staticmethod
    def _in_run(state: frozenset) -> tuple | None:
        if len(state) != 1:
            return None
        (thread,) = state
        top, rest = (thread[-1], thread[:-1]) if thread else (None, ())
        if top is not None and top[0] == "S" and top[6] is not None and not top[3] and not top[4]:
            node, rx, nfa = top[1], top[1].pattern, top[6]
            # NOTE: with no maxLength, past minLength the length stays min_len whatever the run takes
            if node.max_len is not None or top[2] < node.min_len:
                return None
        elif top is not None and top[0] == "X" and not top[3]:
            rx, nfa = top[1], top[2]
        else:
            return None
        run = rx.in_run(nfa)
        if run is None:
            return None
        cset, room, due, after = run
        if top[0] == "S":
            return True, cset, room, due, frozenset((rest + (("S", node, top[2], 0, 0, 0, after),),))
        if rx.accepts(after) and rest and any(_feed(rest, b) and _starts(cset, b) for b in range(256)):
            return None  # the text's suffix could begin with a character of the set
        return False, cset, room, due, frozenset((rest + (("X", rx, after, 0, 0),),))

    @staticmethod
    def string_threads(state: frozenset) -> list[tuple[float, int, frozenset]] | None:
        """Where every thread is inside a string between characters, per thread: (characters it
        may still take (inf: unbounded), characters due before it may close, the state once it has
        closed); None where the state is not such. What a token does there depends only on these
        (``scan_string`` reads the token), so masks need no walk."""
        out = []
        for thread in state:
            top = thread[-1] if thread else None
            if top is None or top[0] != "S" or top[3] or top[4] or top[1].pattern is not None:
                return None
            node, length = top[1], top[2]
            room = math.inf if node.max_len is None else node.max_len - length
            out.append((room, max(0, node.min_len - length), frozenset((_done(thread[:-1]),))))
        return out


def scan_string(piece: bytes) -> tuple[int, int, bytes | None] | None:
    """``piece`` read from inside a string, between characters: (characters it needs room for,
    characters it completes before closing the string (or in all), the bytes after the closing quote,
    None where it does not close); None where no string can hold it (a control byte, a bad
    escape or UTF-8 sequence)."""
    esc = utf8 = need = done = 0
    for i, b in enumerate(piece):
        if not esc and not utf8:
            if b == _QUOTE:
                return need, done, piece[i + 1 :]
            need = max(need, done + 1)  # NOTE: a character starts: the string must have room for it
        step = _string_byte(esc, utf8, b)
        if step is None:
            return None
        esc, utf8, ended = step
        done += ended
    return need, done, None


def scan_chars(piece: bytes, json_text: bool) -> tuple[str, list[int] | None, int, tuple[int, int] | None]:
    """``piece`` read from between characters of a pattern's text: a JSON string's (escapes
    decoded; a quote ends the reading) or, not ``json_text``, plain UTF-8 (a regex guide's). Returns
    (the characters it completes, the byte offset after each (None: their UTF-8 ends), the bytes
    read, the code points a character it leaves unfinished can still become (None: none)); the
    reading stops at the first byte that cannot come."""
    text = plain_text(piece) if json_text else _utf8(piece)
    if text is not None:
        return text, None, len(piece), None
    esc = utf8 = acc = 0
    chars, ends = [], []
    for i, b in enumerate(piece):
        if json_text:
            if b == _QUOTE and not esc and not utf8:
                return "".join(chars), ends, i, None
            step = _string_byte(esc, utf8, b)
        else:
            step = _utf8_byte(utf8, b)
            step = None if step is None else (0, *step)
        if step is None:
            return "".join(chars), ends, i, None
        acc, cp = (0, b) if b == _BACKSLASH and not json_text else _code_point(esc, utf8, acc, b)
        esc, utf8, _ = step
        if cp is not None:
            chars.append(chr(cp))
            ends.append(i + 1)
    return "".join(chars), ends, len(piece), _due_range(esc, utf8, acc)


def plain_text(piece: bytes) -> str | None:
    """The text of a piece that is whole characters of a JSON string's body, no quote, backslash
    or control character; else None."""
    text = _utf8(piece)
    return None if text is None or _NOT_PLAIN.search(text) else text


def _utf8(piece: bytes) -> str | None:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return None


def guide_spec(schema: dict | None = None, prefix: str = "", suffix: str = "", choice: list[str] | None = None,
               regex: str | None = None) -> str:
    """The canonical wire form of a guide: a JSON value matching ``schema`` (None: any JSON
    object), or with ``choice`` exactly one of those strings, or with ``regex`` text it matches
    whole; between ``prefix`` and ``suffix``. Equal guides give equal strings (the cache key)."""
    spec: dict = ({"choice": list(choice)} if choice is not None else {"regex": regex} if regex is not None
                  else {"schema": schema if schema is not None else {"type": "object"}})  # fmt: skip
    if prefix:
        spec["prefix"] = prefix
    if suffix:
        spec["suffix"] = suffix
    try:
        return json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        raise GuideError("the schema is nested too deeply") from None


def check_guide(spec: str) -> None:
    """Raises GuideError where ``spec`` cannot be compiled (compiling it caches the result)."""
    compile_guide(spec)


@functools.lru_cache(maxsize=64)
def compile_guide(spec: str) -> Grammar:
    if not isinstance(spec, str) or not spec:
        raise GuideError("a guide spec must be a non-empty JSON string")
    if len(spec.encode("utf-8")) > MAX_SPEC_BYTES:
        raise GuideError(f"the schema is too large: at most {MAX_SPEC_BYTES // 1024} KiB")
    try:
        parsed = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise GuideError(f"a guide spec must be JSON: {exc}") from None
    if (not isinstance(parsed, dict) or set(parsed) - {"schema", "choice", "regex", "prefix", "suffix"}
            or sum(k in parsed for k in ("schema", "choice", "regex")) != 1):  # fmt: skip
        raise GuideError("a guide spec is {'schema': ..., 'choice': [...] or 'regex': str, 'prefix'?: str, 'suffix'?: str}")
    prefix, suffix = parsed.get("prefix", ""), parsed.get("suffix", "")
    if not isinstance(prefix, str) or not isinstance(suffix, str):
        raise GuideError("a guide's prefix and suffix must be strings")
    if "regex" in parsed:
        if not isinstance(parsed["regex"], str) or not parsed["regex"]:
            raise GuideError("a regex guide must be a non-empty string")
        try:
            return Grammar(Regex(parsed["regex"], whole=True), prefix.encode("utf-8"), suffix.encode("utf-8"))
        except RegexError as exc:
            raise GuideError(str(exc)) from None
    if "choice" in parsed:
        choice = parsed["choice"]
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) and c for c in choice):
            raise GuideError("a choice must be a non-empty list of non-empty strings")
        if len(choice) > MAX_CHOICES:
            raise GuideError(f"a choice may list at most {MAX_CHOICES} strings")
        options = tuple(dict.fromkeys(c.encode("utf-8") for c in choice))
        return Grammar(options, prefix.encode("utf-8"), suffix.encode("utf-8"))
    schema = parsed["schema"]
    compiler = _Compiler(schema if isinstance(schema, dict) else {})
    try:
        root = compiler.node(schema, "schema")
    except RecursionError:
        raise GuideError("the schema is nested too deeply") from None
    _check_choices(root)
    return Grammar(root, prefix.encode("utf-8"), suffix.encode("utf-8"))


def _check_choices(root) -> None:
    """Refuse a schema whose choices (``$ref``, ``anyOf``, ``oneOf``, ``allOf``) lead back to
    themselves before any value begins (``{"$ref": "#"}``: reading a first byte would never end;
    it matches no JSON text, or only through its other options), or nest more than
    ``MAX_UNION_DEPTH`` deep (the matcher opens them one within another). Objects and arrays between two choices break such a loop: their bracket
    comes first."""
    depth: dict[int, int] = {}  # id -> the deepest chain of choices below it; -1 while on the path
    stack = [(root, iter(root.options))] if type(root) is UnionNode else []
    if stack:
        depth[id(root)] = -1
    while stack:
        node, options = stack[-1]
        for option in options:
            if type(option) is not UnionNode:
                continue
            seen = depth.get(id(option))
            if seen == -1:
                raise GuideError("the schema refers to itself before any value begins ($ref, anyOf or allOf "
                                 "chains that lead back to where they started): it cannot be guided")  # fmt: skip
            if seen is None:
                depth[id(option)] = -1
                stack.append((option, iter(option.options)))
                break
        else:
            stack.pop()
            below = [depth[id(o)] for o in node.options if type(o) is UnionNode]
            depth[id(node)] = 1 + max(below, default=0)
            if depth[id(node)] > MAX_UNION_DEPTH:
                raise GuideError(f"the schema's choices ($ref, anyOf, allOf) nest more than {MAX_UNION_DEPTH} deep")
