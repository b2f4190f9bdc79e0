"""Guided JSON decoding: the grammar against Python's json module and the jsonschema validator (the
independent oracles), the token masks against a token-by-token brute force, the sampler's masking,
and the engine's guided generation through prefill, handoff and decode."""

from __future__ import annotations

import functools
import json
import random
import re

import jsonschema
import pytest
import torch

from llmbus.engine.llm import LLM
from llmbus.engine.sampler import Sampler
from llmbus.engine.sampling_params import SamplingParams
from llmbus.engine.sequence import Sequence
from llmbus.guide.grammar import MAX_INDENT, MAX_NUMBER, MAX_THREADS, GuideError, compile_guide, guide_spec
from llmbus.guide.masks import GuideMasks, GuideRun, TokenIndex
from llmbus.model.demo import make_demo_model
from llmbus.model.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "height": {"type": "number"},
        "member": {"type": "boolean"},
        "nick": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", 3, None]}, "minItems": 1, "maxItems": 3},
        "home": {"$ref": "#/$defs/place"},
    },
    "required": ["name", "age", "member"],
    "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"const": "0150"}},
                        "required": ["city"]}},
}
TREE = {  # recursive: a node's children are nodes
    "$ref": "#/$defs/node",
    "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                         "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
                       "required": ["v"]}},
}  # fmt: skip
ANY_OBJECT = {"type": "object"}
CODED = {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                          "code": {"type": "string", "pattern": "^[A-Z]{2}\\d{2,3}$"},
                                          "share": {"type": "number", "minimum": 0, "maximum": 1}},
         "required": ["day", "code", "share"]}  # fmt: skip


def _valid(schema: dict, text: str) -> bool:
    """The oracle: json.loads, then (for a schema) jsonschema; json_object means a top-level object."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError:
        return False
    return True


def _random_value(schema, rng: random.Random, defs: dict, depth: int = 0):
    """A random JSON value valid for ``schema`` (the subset these tests use)."""
    if "$ref" in schema:
        return _random_value(defs[schema["$ref"].split("/")[-1]], rng, defs, depth + 1)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "anyOf" in schema:
        return _random_value(rng.choice(schema["anyOf"]), rng, defs, depth)
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties")
        if not props:  # any object
            return {f"k{i}": rng.choice([1, "x\u00e9\"\\", None, [True, 2.5], {"n": -3e-2}]) for i in range(rng.randrange(3))}
        keys = [k for k in props if k in schema.get("required", []) or (depth < 3 and rng.random() < 0.5)]
        rng.shuffle(keys)
        return {k: _random_value(props[k], rng, defs, depth + 1) for k in keys}
    if kind == "array":
        lo, hi = schema.get("minItems", 0), schema.get("maxItems", 3)
        return [_random_value(schema["items"], rng, defs, depth + 1) for _ in range(rng.randint(lo, hi if depth < 3 else lo))]
    if kind == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", 8)
        return "".join(rng.choice("ab \u00e9\u4e2d\U0001f916\"\\\n/") for _ in range(rng.randint(lo, hi)))
    if kind == "integer":
        return rng.randint(schema.get("minimum", -10**6), schema.get("maximum", 10**6))
    if kind == "number":
        return rng.choice([0, -1.5, 3.25e-7, 12345.678, -2e20])
    if kind == "boolean":
        return rng.random() < 0.5
    return None


def _dumps(value, rng: random.Random) -> str:
    style = rng.randrange(3)
    if style == 0:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=rng.random() < 0.5)
    if style == 1:
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, indent=2, ensure_ascii=False)


@pytest.mark.parametrize("schema", [PERSON, TREE, ANY_OBJECT], ids=["person", "tree", "any-object"])
def test_valid_documents_match_and_their_mutants_match_only_where_valid(schema):
    grammar = compile_guide(guide_spec(schema))
    rng = random.Random(0)
    defs = schema.get("$defs", {})
    for _ in range(150):
        text = _dumps(_random_value(schema, rng, defs), rng)
        data = text.encode("utf-8")
        assert grammar.matches(data), text
        state = grammar.initial
        for i, b in enumerate(data):  # every prefix is alive, and only the whole document ends
            assert not grammar.accepts(state), (text, i)
            state = grammar.step(state, b)
            assert state is not None, (text, i)
        for _ in range(6):  # a mutant the grammar takes must be valid to the oracle
            chars = list(text)
            at = rng.randrange(len(chars) + 1)
            op = rng.randrange(3)
            if op == 0 and chars:
                del chars[min(at, len(chars) - 1)]
            elif op == 1:
                chars.insert(at, rng.choice('{}[]",:0-.eE tnfa\\\u00e9'))
            elif chars:
                chars[min(at, len(chars) - 1)] = rng.choice('{}[]",:01 x')
            mutant = "".join(chars)
            if grammar.matches(mutant.encode("utf-8")):
                assert _valid(schema, mutant), (text, mutant)


def test_what_the_grammar_refuses():
    person = compile_guide(guide_spec(PERSON))
    base = {"name": "Al", "age": 3, "member": True}
    assert person.matches(json.dumps(base).encode())
    for bad in ({"name": "Al", "age": 3}, {**base, "age": 3.5}, {**base, "name": ""}, {**base, "name": "x" * 13},
                {**base, "extra": 1}, {**base, "tags": []}, {**base, "tags": ["blue"]}, {**base, "home": {"zip": "0150"}},
                {**base, "home": {"city": "Oslo", "zip": "150"}}):  # fmt: skip
        assert not person.matches(json.dumps(bad).encode()), bad
    assert not person.matches(b'{"name": "Al", "name": "Bo", "age": 3, "member": true}')  # a key once
    any_object = compile_guide(guide_spec())
    for bad in (b"[1]", b'"s"', b"{} {}", b'{"a": 01}', b'{"a": 1.}', b'{"a": "\x01"}', b'{"a": "\\x"}',
                b'{"a": "\xff"}', b'{"a": "\xc3"}', b"{,}", b'{"a" 1}', b'{"a": tru}', b'{"a": NaN}'):
        assert not any_object.matches(bad), bad
    assert any_object.matches('{"\u00e9\\u00e9\\n": [true, null, -0.5E+2, {}]}'.encode())
    assert not any_object.matches(b' {}') and not any_object.matches(b'\n{}')  # the value comes first
    # strings are valid UTF-8: no overlong forms, no surrogates, nothing past U+10FFFF
    for text, ok in (("\u4e2d", True), ("\U0001f916", True), ("\U0010ffff", True)):
        assert any_object.matches(b'{"a": "' + text.encode() + b'"}') == ok
    for raw in (b"\xe0\x80\xb0", b"\xc0\xb0", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xf0\x80\x80\xb0",
                b"\\udc00", b"\\ud83d", b"\\ud83dx", b"\\ud83d\\u0041"):  # surrogates only in pairs
        assert not any_object.matches(b'{"a": "' + raw + b'"}'), raw
    one = compile_guide(guide_spec({"type": "string", "maxLength": 1, "pattern": "^.$"}))
    assert one.matches(b'"\\ud83e\\udd16"') and one.matches('"\U0001f916"'.encode())  # a pair is one character
    # whitespace: one space or tab, or a line break (\n or \r\n) and an indentation
    for ws, ok in ((b" ", True), (b"\t", True), (b"  ", False), (b"\n\n", False), (b"\r\n" + b" " * MAX_INDENT, True),
                   (b"\n" + b" " * (MAX_INDENT + 1), False), (b"\n\t\t", True), (b"\n \t", False), (b"\r", False)):
        assert any_object.matches(b"{" + ws + b'"a"' + ws + b":" + ws + b"[" + ws + b"1" + ws + b"]" + ws + b"}") == ok, ws
    assert not any_object.matches(b'{"a": ' + b"1" * (MAX_NUMBER + 1) + b"}")
    # a number that could not be finished within the bound is refused where it would dead-end
    assert any_object.advance(any_object.initial, b'{"a": ' + b"1" * (MAX_NUMBER - 1) + b".") is None


def test_ambiguous_schemas_stay_bounded():
    # copies of one option are one node, so they fork no threads
    copies = compile_guide(guide_spec({"anyOf": [{"type": "integer"}] * 50}))
    assert len(copies.advance(copies.initial, b"1")) == 1
    # options that stay alive together, nested: 2^9 readings of the same bytes, refused past MAX_THREADS
    schema: dict = {"type": "integer"}
    for depth in range(9):
        schema = {"anyOf": [{"type": "array", "items": schema, "maxItems": 1},
                            {"type": "array", "items": schema, "maxItems": 2}]}
    nested = compile_guide(guide_spec(schema))
    state = nested.advance(nested.initial, b"[" * 8)
    assert state is not None and len(state) == 2**8 == MAX_THREADS
    assert nested.advance(state, b"[") is None  # 2^9 readings: refused


def test_a_choice_is_one_of_its_strings_as_text():
    grammar = compile_guide(guide_spec(choice=["yes", "no", "yes please", " maybe", "\u00e9t\u00e9"]))
    for text, ok in (("yes", True), ("yes please", True), (" maybe", True), ("\u00e9t\u00e9", True), ("ye", False),
                     ("yes ", False), ('"yes"', False), ("maybe", False)):  # fmt: skip
        assert grammar.matches(text.encode()) == ok, text
    assert grammar.accepts(grammar.advance(grammar.initial, b"yes"))  # "yes" may end here or go on
    for bad in ([], [""], ["a", 3], "yes"):
        with pytest.raises(GuideError, match="choice"):
            compile_guide(json.dumps({"choice": bad}))


def test_a_regex_lets_out_nothing_it_cannot_finish():
    """A pattern that matches nothing is refused; a branch that can never end lets no character out
    (its start is not a way to the end); a character class holds nothing past U+10FFFF."""
    for pattern in (r"[^\s\S]", r"a[^\s\S]", r"(x[^\d\D])+"):
        with pytest.raises(GuideError, match="matches no text"):
            compile_guide(guide_spec(regex=pattern))
    grammar = compile_guide(guide_spec(regex=r"a[^\s\S]|b|[^\s\Sa]c"))
    assert [b for b in range(256) if grammar.step(grammar.initial, b) is not None] == [ord("b")]
    high = compile_guide(guide_spec(regex=r"[^\u0000-\uffff]"))  # U+10000 and up: four bytes, F0-F4 first
    assert [b for b in range(256) if high.step(high.initial, b) is not None] == [0xF0, 0xF1, 0xF2, 0xF3, 0xF4]
    assert high.matches("\U0010ffff".encode()) and not high.matches(b"\xf4\x90\x80\x80")


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"(yes|no)( please)?", r"[a-z\u00e9 ]+", r"^a.c$", r"x*",
                                     r"[^\n]{0,5}\n?"])  # fmt: skip
def test_a_regex_guide_matches_the_whole_text_as_re_fullmatch_does(pattern):
    grammar = compile_guide(guide_spec(regex=pattern))
    oracle = re.compile(pattern.removeprefix("^").removesuffix("$"), re.ASCII)
    rng = random.Random(pattern)
    alphabet = "ab c-0123yesnopl\u00e9x\n\U0001f916"
    for _ in range(1500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 9)))
        assert grammar.matches(text.encode()) == (oracle.fullmatch(text) is not None), repr(text)
    framed = compile_guide(guide_spec(regex=r"\d+", prefix="<", suffix=">"))
    assert framed.matches(b"<123>") and not framed.matches(b"<>") and not framed.matches(b"<1a>")


def test_prefix_and_suffix_frame_the_value():
    grammar = compile_guide(guide_spec({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                                       prefix="<tool_call>\n", suffix="\n</tool_call>"))
    assert grammar.matches(b'<tool_call>\n{"x": 1}\n</tool_call>')
    assert not grammar.matches(b'<tool_call>\n{"x": 1}')
    assert not grammar.matches(b'{"x": 1}\n</tool_call>')


PATTERNS = {  # pattern: a string it matches, which the test also mutates
    r"^\d{4}-\d{2}-\d{2}$": "2024-05-17", r"^[a-z]+(?:-[a-z]+)*$": "ab-cd", r"ab|cd": "xcdy", r"^(ab|c)*d?$": "abcd",
    r"^[^@\s]+@[^@\s]+\.[a-z]{2,}$": "a@b.cd", r"^\w{2,5}$": "a_9", r"x{2,}y{0,1}": "axxy", r"^[A-F0-9]{1,3}\.?$": "A0.",
    r"^.$": "\u00e9", r"^[\d\-\u00e9]+$": "1-\u00e9", r"^\u00e9+\n?$": "\u00e9\n", r'^"[^"]*"$': '"ab"', r"[^a-c]": "abd",
    r"^(a|b){2,3}\\$": "ab\\",
}  # fmt: skip


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_is_searched_in_the_decoded_string_as_re_does(pattern):
    grammar = compile_guide(guide_spec({"type": "string", "pattern": pattern}))
    oracle = re.compile(pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern, re.ASCII)  # JS's $: the end
    rng = random.Random(pattern)
    alphabet = 'abcdxyAF09-@. \u00e9\n_"\\\U0001f916'
    hits = 0
    for _ in range(1500):
        if rng.random() < 0.5:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 9)))
        else:  # an edit of the example
            chars = list(PATTERNS[pattern])
            for _ in range(rng.randrange(3)):
                at = rng.randrange(len(chars) + 1)
                if rng.random() < 0.5 and chars:
                    del chars[min(at, len(chars) - 1)]
                else:
                    chars.insert(at, rng.choice(alphabet))
            text = "".join(chars)
        want = oracle.search(text) is not None
        hits += want
        assert grammar.matches(json.dumps(text, ensure_ascii=rng.random() < 0.5).encode()) == want, repr(text)
    assert hits > 0


@pytest.mark.parametrize("bounds", [{"minimum": 0}, {"minimum": -5, "maximum": 12}, {"exclusiveMaximum": 0},
                                    {"minimum": 1, "maximum": 100}, {"exclusiveMinimum": 9.5, "maximum": 1234},
                                    {"minimum": -1000, "exclusiveMaximum": -999}])  # fmt: skip
def test_integer_bounds_are_enforced_digit_by_digit(bounds):
    schema = {"type": "object", "properties": {"n": {"type": "integer", **bounds}}, "required": ["n"]}
    grammar = compile_guide(guide_spec(schema))
    rng = random.Random(json.dumps(bounds))
    for v in [*range(-130, 130), *(rng.randrange(-10**6, 10**6) for _ in range(200)), 10**17, -(10**17)]:
        text = json.dumps({"n": v})
        assert grammar.matches(text.encode()) == _valid(schema, text), v
    assert not grammar.matches(b'{"n": 012}') and not grammar.matches(b'{"n": -0}')


@pytest.mark.parametrize("bounds", [{"minimum": 0}, {"minimum": 0, "maximum": 1}, {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
                                    {"minimum": -3, "exclusiveMaximum": 2}, {"maximum": -1}, {"exclusiveMaximum": 0},
                                    {"minimum": -2, "maximum": -2}, {"exclusiveMinimum": -5, "maximum": 0}])  # fmt: skip
def test_number_bounds_are_enforced_on_the_decimal_text(bounds):
    schema = {"type": "object", "properties": {"x": {"type": "number", **bounds}}, "required": ["x"]}
    grammar = compile_guide(guide_spec(schema))
    rng = random.Random(json.dumps(bounds))
    for _ in range(2000):
        v = round(rng.uniform(-7, 7), rng.randint(0, 5))
        text = rng.choice([repr(v), f"{v:.2f}", str(int(v)), f"{v:.6f}"])
        doc = '{"x": ' + text + "}"
        ok = grammar.matches(doc.encode())
        assert not ok or _valid(schema, doc), doc  # what it takes is valid
        if _valid(schema, doc) and not text.startswith("-0") and "e" not in text:
            assert ok, doc  # and it takes every plain spelling of a valid value ("-0.0" aside)


def test_keywords_beside_a_combinator_hold_for_every_option():
    """JSON Schema applies a schema's keywords beside anyOf/oneOf/allOf too, and an enum's type:
    the "at least one of these" object, a string allOf with a length, an enum of mixed types."""
    at_least_one = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    "additionalProperties": False, "anyOf": [{"required": ["x"]}, {"required": ["y"]}]}
    cases = [(at_least_one, ['{"x":1}', '{"y":2}', '{"y":2,"x":1}'], ["{}", "5", '{"z":1}', '{"x":"1"}']),
             ({"allOf": [{"type": "string"}], "maxLength": 2}, ['"ab"', '""'], ['"abc"', "1"]),
             ({"type": "integer", "enum": [1, 2, "three"]}, ["1", "2"], ['"three"']),
             ({"anyOf": [{"type": "integer"}, {"type": "number"}], "minimum": 3}, ["3", "4.5"], ["2", "2.5"]),
             # a nullable integer written as a type list (OpenAPI 3.1's way): the bounds hold for the integers
             ({"type": ["integer", "null"], "minimum": 2}, ["2", "null"], ["1", '"x"'])]  # fmt: skip
    for schema, good, bad in cases:
        grammar = compile_guide(guide_spec(schema))
        for text in good:
            assert grammar.matches(text.encode()) and _valid(schema, text), (schema, text)
        for text in bad:
            assert not grammar.matches(text.encode()), (schema, text)


def test_a_declared_property_comes_once_even_beside_additional_ones():
    """With additionalProperties a schema, a declared name typed again went down the extra-key
    path: {"a":11,"a":""} passed, and a parser keeps the last "a", a string where an integer is
    due. An escaped spelling of a declared name ("\\u0061") is refused with it."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "": {"type": "integer"}},
              "additionalProperties": {"type": "string", "maxLength": 1}}
    grammar = compile_guide(guide_spec(schema))
    for text in ('{"a":1,"b":"x"}', '{"b":"x","a":2}', '{"ab":"x","a":3,"":4}', '{"aa":"y"}'):
        assert grammar.matches(text.encode()) and _valid(schema, text), text
    for text in ('{"a":11,"a":""}', '{"a":1,"a":2}', '{"":1,"":2}', '{"\\u0061":"x"}', '{"a":"x"}'):
        assert not grammar.matches(text.encode()), text


def test_a_date_is_a_calendar_day():
    """format date (and date-time's date) takes only days that exist: the 31st of a 30-day month and
    February's 29th outside leap years were taken, and jsonschema's format checker refuses them."""
    grammar = compile_guide(guide_spec({"type": "string", "format": "date"}))
    for day, real in (("2024-02-29", True), ("2000-02-29", True), ("2023-02-29", False), ("1900-02-29", False),
                      ("3333-11-31", False), ("2023-04-30", True), ("2023-12-31", True), ("2023-02-28", True)):  # fmt: skip
        assert grammar.matches(json.dumps(day).encode()) == real, day
        assert _valid({"type": "string", "format": "date"}, json.dumps(day)) == real, day


def test_string_formats_are_enforced():
    for fmt, good, bad in (("date", "2024-02-29", "2024-13-01"), ("date-time", "2024-02-29T23:59:59.5+01:00", "2024-02-29 23:59:59"),
                           ("time", "08:30:00Z", "8:30"), ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123e4567"),
                           ("email", "a.b@example.org", "a b@example.org"), ("ipv4", "10.0.255.1", "10.0.256.1")):  # fmt: skip
        grammar = compile_guide(guide_spec({"type": "string", "format": fmt}))
        assert grammar.matches(json.dumps(good).encode()) and not grammar.matches(json.dumps(bad).encode()), fmt
        if fmt != "time":  # (jsonschema checks draft 3's time, without an offset)
            assert _valid({"type": "string", "format": fmt}, json.dumps(good))  # the oracle agrees on the good one


@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "pattern": "(?=a)b"}, "lookaround"),
    ({"type": "string", "pattern": r"(a)\1"}, "backreferences"),
    ({"type": "number", "minimum": 0.5}, "must be a whole number"),
    ({"type": "string", "maximum": 3}, "'maximum' is supported with type 'integer' or 'number' only"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number lies within"),
    ({"type": "integer", "minimum": 3, "exclusiveMaximum": 3}, "no integer lies within"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' is not supported"),
    ({"type": "object", "properties": {"a": {"type": "thing"}}}, "unknown type 'thing'"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required properties ['b']"),
    ({"$ref": "https://example.com/s.json"}, "only local references"),
    ({"$ref": "#/$defs/missing"}, "names nothing"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "'maxLength' (2) is below 'minLength' (3)"),
    ({"allOf": [{}, {}]}, "'allOf' is supported with exactly one"),
    ({"enum": []}, "'enum' must be a non-empty array"),
    # keywords beside enum, const and $ref were ignored (outputs broke them); now refused by name
    ({"type": "integer", "enum": [1, 2, 3, 4], "minimum": 3}, "'minimum' beside 'enum'"),
    ({"type": "string", "enum": ["abcdef", "ab"], "maxLength": 3}, "'maxLength' beside 'enum'"),
    ({"type": "string", "const": 5}, "no value of 'const' is of type 'string'"),
    ({"$defs": {"N": {"type": "string"}}, "$ref": "#/$defs/N", "maxLength": 3}, "'maxLength' beside '$ref'"),
    # ... and beside anyOf / allOf, merged into each option where one schema can hold both
    ({"type": "string", "anyOf": [{"type": "integer"}]}, "'type' both beside and inside"),
    ({"additionalProperties": False, "anyOf": [{"properties": {"z": {}}}]}, "different sides"),
    # choices that lead back to themselves before a value begins: reading a byte would never end
    ({"$ref": "#"}, "refers to itself before any value begins"),
    ({"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}, "refers to itself"),
    ({"$defs": {"x": {"anyOf": [{"$ref": "#/$defs/y"}, {"type": "string"}]}, "y": {"allOf": [{"$ref": "#/$defs/x"}]}},
      "$ref": "#/$defs/x"}, "refers to itself"),
    (functools.reduce(lambda s, _: {"anyOf": [s]}, range(65), {"type": "string"}), "nest more than 64 deep"),
    (functools.reduce(lambda s, _: {"type": "array", "items": s}, range(1000), {}), "nested too deeply"),
])  # fmt: skip
def test_schemas_it_cannot_enforce_are_refused_clearly(schema, words):
    with pytest.raises(GuideError) as err:
        compile_guide(guide_spec(schema))
    assert words in str(err.value)
    with pytest.raises(ValueError):  # SamplingParams validates the same way (GuideError is a ValueError)
        SamplingParams(guide=guide_spec(schema))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(guide=guide_spec(), ignore_eos=True)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("guide") / "small", "small")


@pytest.fixture(scope="module")
def index(demo_dir):
    return TokenIndex.from_tokenizer(Tokenizer.from_dir(demo_dir))


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    """The demo model with a SentencePiece tokenizer (Llama 2 / Mistral style: '\u2581' for spaces,
    <0xNN> byte pieces, so tokens holding part of a character)."""
    return make_demo_model(tmp_path_factory.mktemp("guide-sp") / "small", "small", tokenizer="sentencepiece")


@pytest.mark.parametrize("tokenizer", ["bpe", "sentencepiece"])
def test_masks_equal_a_token_by_token_brute_force(tokenizer, request):
    tok = Tokenizer.from_dir(request.getfixturevalue("demo_dir" if tokenizer == "bpe" else "sp_dir"))
    index = TokenIndex.from_tokenizer(tok)
    pieces = {i: tok.token_bytes(i) for i in range(tok.vocab_size)}
    specials = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    rng = random.Random(1)
    for schema in (PERSON, ANY_OBJECT, TREE, CODED):
        grammar = compile_guide(guide_spec(schema))
        text = (b'{"day": "2024-05-17", "code": "AB123", "share": 0.25}' if schema is CODED
                else _dumps(_random_value(schema, rng, schema.get("$defs", {})), rng).encode())
        if tokenizer == "sentencepiece":
            assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces.values())  # byte pieces are there
        state = grammar.initial
        for i in range(len(text) + 1):
            want = {t for t, p in pieces.items() if p and t not in specials and grammar.advance(state, p) is not None}
            got = index.allowed(grammar, state)
            assert len(got) == len(set(got)) and set(got) == want, (text[:i], len(got), len(want))
            if i < len(text):
                state = grammar.step(state, text[i])


def test_the_mask_cache_is_bounded_by_ids_and_keeps_the_recent(index):
    masks = GuideMasks(index)
    masks.MASK_IDS = 40
    spec = guide_spec(PERSON)
    run = GuideRun(spec)
    text = b'{"age": 1, "member": true, "name": "x"}'
    structural = []
    for i in range(len(text)):
        run.state = compile_guide(spec).advance(compile_guide(spec).initial, text[:i])
        ids, _ = masks.mask(run, torch.device("cpu"))
        if compile_guide(spec).string_threads(run.state) is None:
            structural.append((run.state, ids))
    assert masks._mask_ids <= 40 or len(masks._masks) == 1
    assert masks._mask_ids == sum(v[0].numel() for v in masks._masks.values())
    last_state, last_ids = structural[-1]
    assert torch.equal(masks._masks[(spec, last_state)][0], last_ids)  # the newest stays


def _seq(rid: str, params: SamplingParams, output: list[int] | None = None) -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=[1, 2, 3], params=params, eos_token_ids=(0,),
                    output_token_ids=list(output or []))


@pytest.mark.parametrize("native", [True, False])
def test_the_sampler_draws_only_allowed_tokens_and_reports_raw_logprobs(demo_dir, index, native, monkeypatch):
    monkeypatch.setenv("LLMBUS_CPU_SAMPLER", "native" if native else "torch")
    tok = Tokenizer.from_dir(demo_dir)
    spec = guide_spec(PERSON)
    grammar = compile_guide(spec)
    sampler = Sampler(seed=0)
    sampler.guides = GuideMasks(index)
    v = tok.vocab_size + 7  # embedding rows past the tokenizer are never allowed
    gen = torch.Generator().manual_seed(0)
    seqs = [_seq("g0", SamplingParams(temperature=0, guide=spec, logprobs=2)),
            _seq("g1", SamplingParams(temperature=1.0, top_p=0.9, guide=spec, seed=5)),
            _seq("free", SamplingParams(temperature=0))]
    for step in range(40):
        logits = torch.randn(len(seqs), v, generator=gen) * 4
        out = sampler(logits, seqs)
        for s, t in zip(seqs, out.token_ids):
            if s.params.guide:
                state = grammar.advance(grammar.initial, b"".join(tok.token_bytes(x) for x in s.output_token_ids))
                if t == 0:  # the end token: only where the object is complete
                    assert grammar.accepts(state), (step, s.request_id)
                else:
                    assert t < tok.vocab_size and grammar.advance(state, tok.token_bytes(t)) is not None, (step, s.request_id)
            s.output_token_ids.append(t)
        raw = logits[0].log_softmax(-1)
        assert out.logprobs[0].logprob == pytest.approx(float(raw[out.token_ids[0]]), abs=1e-5)
        seqs = [s for s in seqs if not (s.output_token_ids and s.output_token_ids[-1] == 0)]
        if not seqs:
            break


def test_a_sequence_that_ends_may_end_only_where_its_grammar_does(index):
    spec = guide_spec({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})
    sampler = Sampler(seed=0)
    sampler.guides = GuideMasks(index)
    seq = _seq("e", SamplingParams(temperature=0, guide=spec))
    logits = torch.zeros(1, 2048)
    logits[0, 0] = 50.0  # EOS is by far the likeliest, but the object is not closed
    assert sampler(logits, [seq]).token_ids != [0]
    done = index.allowed(compile_guide(spec), compile_guide(spec).advance(compile_guide(spec).initial, b'{"a":true}'))
    assert done == []  # the object is closed: only an end token may follow


@pytest.fixture(scope="module")
def llm(demo_dir):
    return LLM(str(demo_dir), dtype="float32", device="cpu")


SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"},
                                          "word": {"enum": ["yes", "no", "maybe"]},
                                          "note": {"type": "string", "maxLength": 6}},
         "required": ["ok", "n", "word", "note"], "additionalProperties": False}  # fmt: skip


def test_guided_generation_follows_patterns_and_formats(llm):
    outs = llm.generate(["A code:", "Today is"], [SamplingParams(max_tokens=200, temperature=t, seed=2, guide=guide_spec(CODED))
                                                 for t in (0, 1.0)])  # fmt: skip
    for out in outs:
        assert out.finish_reason == "stop" and _valid(CODED, out.text), out.text


def test_guided_generation_with_a_sentencepiece_vocabulary(sp_dir):
    sp = LLM(str(sp_dir), dtype="float32", device="cpu")
    outs = sp.generate(["A JSON answer:", "Codes:"], [SamplingParams(max_tokens=300, temperature=t, seed=8, guide=guide_spec(schema))
                                                      for t, schema in ((0.9, SMALL), (0.9, CODED))])  # fmt: skip
    for out, schema in zip(outs, (SMALL, CODED)):
        assert out.finish_reason == "stop" and _valid(schema, out.text), out.text


def test_guided_choice_generation_picks_one(llm):
    choices = ["positive", "negative", "neutral"]
    outs = llm.generate(["The review was"] * 3, [SamplingParams(max_tokens=20, temperature=t, seed=5, guide=guide_spec(choice=choices))
                                                 for t in (0, 0.8, 1.5)])  # fmt: skip
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs), [o.text for o in outs]


def test_guided_generation_is_valid_json_greedy_and_sampled(llm):
    spec = guide_spec(SMALL)
    prompts = ["A JSON answer:", "Tell me about the weather", "x"]
    params = [SamplingParams(max_tokens=200, temperature=0, guide=spec),
              SamplingParams(max_tokens=200, temperature=1.0, seed=3, guide=spec),
              SamplingParams(max_tokens=200, temperature=0.7, top_k=50, seed=4, guide=spec)]
    outs = llm.generate(prompts, params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert _valid(SMALL, out.text), out.text
    free = llm.generate(prompts[:1], SamplingParams(max_tokens=30, temperature=0))[0]
    assert not _valid(SMALL, free.text)  # the demo model alone writes no such thing


def test_a_preempted_guided_sequence_continues_identically(demo_dir, llm):
    """Recompute after preemption keeps the output tokens: the guide's state is rebuilt from them."""
    spec = guide_spec(SMALL)
    params = [SamplingParams(max_tokens=200, temperature=0.9, seed=20 + i, guide=spec) for i in range(4)]
    prompts = [f"Request {i} wants JSON" for i in range(4)]
    roomy = llm.generate(prompts, params)
    tight = LLM(str(demo_dir), dtype="float32", device="cpu", num_blocks=16, max_num_batched_tokens=32)
    squeezed = tight.generate(prompts, params)
    assert tight.engine.num_preemptions > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]
    for o in squeezed:
        assert _valid(SMALL, o.text), o.text
    leaks = tight.engine.leak_check()
    assert leaks["free_blocks"] == leaks["total_blocks"]


def test_a_handoff_continues_the_guided_output_identically(demo_dir, llm):
    spec = guide_spec(SMALL)
    params = SamplingParams(max_tokens=200, temperature=0.8, seed=11, guide=spec)
    whole = llm.generate(["Give me JSON"], params)[0]
    prompt = llm.encode("Give me JSON")
    prefill = LLM(str(demo_dir), dtype="float32", device="cpu").engine
    decode = LLM(str(demo_dir), dtype="float32", device="cpu").engine
    prefill.add_request("h", prompt, params, prefill_only=True)
    first = []
    while prefill.has_unfinished():
        for out in prefill.step():
            first.extend(out.new_token_ids)
    state, kv = prefill.export_sequence("h")
    decode.import_sequence(state, kv, params)
    rest = []
    while decode.has_unfinished():
        for out in decode.step():
            rest.extend(out.new_token_ids)
    assert first + rest == whole.token_ids
    assert _valid(SMALL, llm.tokenizer.decode(first + rest))


def test_the_guide_index_is_built_once_ahead_of_the_first_guided_request(demo_dir):
    import threading

    engine = LLM(str(demo_dir), dtype="float32", device="cpu").engine
    assert engine.runner.sampler.guides is None  # in process: built on first use
    threads = [threading.Thread(target=engine.prepare_guides) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    guides = engine.runner.sampler.guides
    assert guides is not None
    engine.add_request("g", [1, 2, 3], SamplingParams(max_tokens=4, guide=guide_spec()))
    assert engine.runner.sampler.guides is guides


def test_an_engine_without_a_tokenizer_refuses_a_guide(demo_dir, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(demo_dir, bare)
    (bare / "tokenizer.json").unlink()
    engine = LLM(str(bare), dtype="float32", device="cpu").engine
    with pytest.raises(ValueError, match="tokenizer.json"):
        engine.add_request("r", [1, 2, 3], SamplingParams(guide=guide_spec()))
    assert engine.leak_check()["requests"] == 0
