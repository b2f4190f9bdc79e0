"""Stop strings over streamed text: checked against a whole-text reference on random splits."""

import random

import pytest

from services.gateway.stop import StopStringMatcher


def _reference(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


def _stream(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], bool]:
    m = StopStringMatcher(stops)
    out = [m.feed(p) for p in pieces]
    out.append(m.flush())
    return out, m.stopped


@pytest.mark.parametrize("seed", range(200))
def test_random_splits_match_reference(seed):
    rng = random.Random(seed)
    alphabet = "ab\u00e9 c"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))})
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out, stopped = _stream(pieces, stops)
    want, want_stopped = _reference(text, stops)
    assert "".join(out) == want
    assert stopped == want_stopped


def test_holds_back_a_possible_prefix_then_releases_it():
    m = StopStringMatcher(("END",))
    assert m.feed("hello E") == "hello "
    assert m.feed("N") == ""
    assert m.feed("x") == "ENx"
    assert not m.stopped


def test_stop_string_split_across_pieces_is_not_returned():
    m = StopStringMatcher(("\n\n", "STOP"))
    assert m.feed("one\n") == "one"
    assert m.feed("\ntwo") == ""
    assert m.stopped and m.matched == "\n\n"
    assert m.feed("more") == "" and m.flush() == ""


def test_earliest_stop_wins():
    m = StopStringMatcher(("cd", "b"))
    assert m.feed("abcd") == "a"
    assert m.matched == "b"


def test_no_stops_passes_text_through():
    m = StopStringMatcher()
    assert m.feed("abc") == "abc" and m.flush() == ""


def test_empty_stop_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(("",))
