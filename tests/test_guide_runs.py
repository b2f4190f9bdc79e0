"""Masks inside counted runs of one character set (``.{0,256}``, ``[a-z]{1,200}``; llmbus.guide.runs)
against the trie walk and a token-by-token brute force, at every byte of an output: where a run
ends and what follows begins, multi-byte characters and tokens holding part of one, JSON escapes,
line breaks against ``.``, negated classes, a regex guide's suffix."""

from __future__ import annotations

import pytest
import torch

from llmbus.guide.grammar import compile_guide, guide_spec
from llmbus.guide.masks import GuideMasks, GuideRun, TokenIndex
from llmbus.guide.regex import Regex
from llmbus.model.demo import make_demo_model
from llmbus.model.tokenizer import Tokenizer

# a vocabulary of every byte and pieces that straddle where runs end: characters of every UTF-8
# length, parts of them, line breaks raw and escaped, quotes, escapes cut short
SYNTHETIC = list(dict.fromkeys([bytes([b]) for b in range(256)] + [p.encode() for p in (
    "ab", "abc", "abcdef", "abcdefghijklmn", "12", "123", "1234", "123-", "12-", "3-a", "-1", "-12%", "--", "a-",
    "d-1", "%\u00e9", "\u00e9", "\u00e9a", "a\u00e9", "\u4e2d\u6587", "\U0001f600", "a\U0001f600", " y", "yz", "x!",
    "\n", "a\n", "\n]", "\u2028", "x\u2028", "\u0085", '"', 'a"', '"}', '"x', 'y"', '3"}', "\\n", '\\"', '\\"x',
    "\\u00e9", "\\u00", "\\u20", "\\u2028", "\\u4e2d", "\\ud83d", "\\ud83d\\ude00", "\\", "a\\", "z.", ".a", "a.b",
    "b.c", ".def", "c.d", "s", '"s', '": "', ': "', '"1', "abcx", "cx!", "c\u00e9\n",
)] + [b"a\xe4", b"\xe4\xb8", b"\xb8\xad", b"\xf0\x9f", b"\x98\x80", b"\xe2\x80", b"\xa8"]))  # fmt: skip

CASES = [  # (guide spec, an output it allows, whether counted runs are met along it)
    (guide_spec({"type": "string", "pattern": "^.{0,12}$"}), '"caf\u00e9 \\u4e2d\\"x\U0001f600 y"', True),
    (guide_spec({"type": "string", "pattern": "^[a-z]{2,6}-[^a-z\\s]{1,5}$"}), '"abcd-12%\u00e9"', True),
    (guide_spec({"type": "string", "pattern": "^(?:[a-z]{1,3}\\.){2}[a-z]{0,4}$"}), '"ab.c.defg"', True),
    (guide_spec({"type": "object", "properties": {"s": {"type": "string", "pattern": "^\\d{0,4}$"}}, "required": ["s"]}),
     '{"s": "123"}', True),
    (guide_spec({"type": "string", "pattern": "^[a-z]{0,8}$", "minLength": 2}), '"abcdefg"', True),  # once 2 are in
    # a maxLength (or minLength) still to check: the string's own length is part of the state
    (guide_spec({"type": "string", "pattern": "^[a-z]{0,8}$", "minLength": 2, "maxLength": 5}), '"abcd"', False),
    (guide_spec(regex="^\\d{3}-.{0,8}$"), "123-a\u00e9 \U0001f600", True),
    (guide_spec(regex="[^\\n]{0,5}", suffix="\n]"), "ab\u00e9\n]", True),
    (guide_spec(regex="\\d{2}[^\\d]{0,3}"), "12\u2028ab", True),
    # the suffix could begin with a letter of the run: where it ends is not the first other letter
    (guide_spec(regex="[a-z]{0,5}", suffix="x!"), "abcx!", False),
    # the run is followed by more of its set: no run is described there
    (guide_spec({"type": "string", "pattern": "^.{0,6}x$"}), '"abx"', False),
    # searched, not anchored at the end: once a letter is in anything may follow, one state
    (guide_spec({"type": "string", "pattern": "^[a-z]{1,20}"}), '"ab\\n1 éx"', False),
    (guide_spec({"type": "string", "pattern": "\\d{2,5}"}), '"x123456y"', False),
]  # fmt: skip


@pytest.fixture(scope="module")
def sp_pieces(tmp_path_factory):
    """The demo SentencePiece vocabulary (byte pieces: tokens holding part of a character)."""
    model = make_demo_model(tmp_path_factory.mktemp("runs-sp") / "small", "small", tokenizer="sentencepiece")
    return TokenIndex.from_tokenizer(Tokenizer.from_dir(model)).pieces


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("vocabulary", ["synthetic", "sentencepiece"])
def test_masks_in_counted_runs_equal_the_walk_and_a_brute_force(vocabulary, case, request):
    spec, text, runs_met = CASES[case]
    pieces = SYNTHETIC if vocabulary == "synthetic" else request.getfixturevalue("sp_pieces")
    index = TokenIndex(pieces)
    grammar = compile_guide(spec)
    masks = GuideMasks(index)
    data = text.encode()
    assert grammar.matches(data)
    state, met = grammar.initial, 0
    for i in range(len(data) + 1):
        want = {t for t, p in enumerate(pieces) if p and grammar.advance(state, p) is not None}
        walked: list[int] = []
        index._walk(grammar, state, 0, len(index.all.pieces), 0, walked)
        got = index.allowed(grammar, state)
        assert len(got) == len(set(got)) and set(got) == want == set(walked), (data[:i], sorted(set(got) ^ want))
        run = GuideRun(spec)
        run.state = state
        ids, may_end = masks.mask(run, torch.device("cpu"))
        assert sorted(ids.tolist()) == sorted(got) and may_end == (grammar.accepts(state) or not got)
        met += grammar.in_run(state) is not None
        if i < len(data):
            state = grammar.step(state, data[i])
    assert (met > 0) == runs_met, met


def test_a_pattern_that_has_matched_stops_changing_state():
    """Where any text may follow (a pattern without ``$`` once it has matched), the states are one
    set whatever came before, so its masks are cached once, not per place in a run."""
    for pattern, texts in (("^[a-z]{1,200}", ["a", "ab", "abc1", "abc\n\u00e9"]), ("\\d{2,5}", ["x12", "12345", "x123456y"]),
                           ("^x[\\s\\S]*$", ["x", "xy\n"])):  # fmt: skip
        rx = Regex(pattern)
        states = set()
        for text in texts:
            at = rx.initial
            for c in text:
                at = rx.step(at, ord(c))
            states.add(at)
        assert len(states) == 1 and rx.accepts(states.pop()), pattern


def test_a_warmed_index_builds_nothing_at_the_first_dot_run(sp_pieces):
    """``Runs.warm`` (a worker's startup thread, ``Engine.prepare_guides``) reads the vocabulary and
    builds ``.``'s tables for both kinds of text, so the first request with such a run builds none
    on the engine thread."""
    index = TokenIndex(sp_pieces)
    index.runs.warm()
    built = (dict(index.runs._scans), dict(index.runs._sets))
    assert set(built[0]) == {True, False} and len(built[1]) == 2
    masks = GuideMasks(index)
    quote = sp_pieces.index(b'"')
    for spec, output in ((guide_spec({"type": "string", "pattern": "^.{0,256}$"}), [quote]),
                         (guide_spec(regex="^.{0,256}$"), [])):  # fmt: skip
        run = GuideRun(spec)
        masks.advance(run, output, set())
        assert run.grammar.in_run(run.state) is not None  # a place in the run: masked from its tables
        ids, _ = masks.mask(run, torch.device("cpu"))
        assert ids.numel() > len(sp_pieces) // 2
    assert (dict(index.runs._scans), dict(index.runs._sets)) == built
