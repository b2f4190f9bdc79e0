"""Which tokens may come inside a counted run of one character set (``.{0,256}``, ``[a-z]{1,200}``).

Each place in such a run is a pattern state of its own, so masks cached per state never hit and a
walk per token would cost tens of milliseconds. But there a token's fate is simple
(``Grammar.in_run``): the run takes characters of its set, at most ``room`` more, and can end once
``due`` more are taken; the pattern after it cannot take a character of the set, so a token leaves
the run at its first character outside the set (or its JSON string's closing quote), if at all.
So a token whose first ``a`` characters are in the set is allowed

- within the run, if it is all in the set (a character it leaves unfinished can still become
  one): ``need`` = ``a`` (+1 for the unfinished one) <= room;
- leaving it, if ``due`` <= ``a`` <= room and its bytes from there are allowed where the run has
  ended (that state does not change along the run, so this is checked once per run).

What a token is made of is read once per set (and kind of text: a JSON string's or plain), what
follows a run once per run; a mask is then two bisections and slices.
"""

from __future__ import annotations

import bisect
import re
from collections import OrderedDict

from llmbus.guide.grammar import Grammar, scan_chars
from llmbus.guide.regex import ANY, meets

MAX_SETS = 16  # character sets whose tables are kept: each is as long as the vocabulary
MAX_LEAVING_IDS = 1 << 22  # token ids kept in the tables of what follows a run (8 bytes each: 32 MiB)


class SetTable:
    """The vocabulary read against one character set: ``ids`` (with ``need`` ascending) the tokens
    all in the set, and the tokens with bytes past their first characters in the set, as
    (id, those characters, where their bytes end, ``need`` or None)."""

    def __init__(self, pieces: list[bytes | None], scans: list, cset) -> None:
        inside = _python_class(cset)
        stay, self.leaving = [], []
        for i, piece in enumerate(pieces):
            if piece is None or scans[i] is None:
                continue
            text, ends, read, partial = scans[i]
            a = inside.match(text).end()
            at = (ends[a - 1] if a else 0) if ends is not None else len(text[:a].encode("utf-8"))
            whole = read == len(piece) and a == len(text) and (partial is None or meets(cset, *partial))
            need = a + (partial is not None) if whole else None
            if whole:
                stay.append((need, i))
            if at < len(piece):
                self.leaving.append((i, a, at, need))
        stay.sort()
        self.need = [n for n, _ in stay]
        self.ids = [i for _, i in stay]
        self.tensors: dict = {}  # device -> ids as a tensor (GuideMasks)


class Leaving:
    """The tokens that leave a run into one state: those leaving with nothing unfinished (``ids``,
    by ``a`` ascending), and those all in the set but one unfinished character, which the state
    after the run takes instead (``partial_ids``, by ``a``)."""

    def __init__(self, grammar: Grammar, pieces: list[bytes | None], table: SetTable, after: frozenset) -> None:
        whole, partial = [], []
        for i, a, at, need in table.leaving:
            if grammar.advance(after, pieces[i][at:]) is not None:
                (whole if need is None else partial).append((a, i))
        whole.sort()
        partial.sort()
        self.a, self.ids = [a for a, _ in whole], [i for _, i in whole]
        self.partial_a, self.partial_ids = [a for a, _ in partial], [i for _, i in partial]

    def allowed(self, room: int, due: int) -> list[int]:
        """Tokens that leave the run after ``due``..``room`` characters (those that could instead
        stay in it, ``need`` <= room, are ``SetTable.ids``' and not listed again)."""
        out = self.ids[bisect.bisect_left(self.a, due) : bisect.bisect_right(self.a, room)]
        if room >= due:  # NOTE: need = a + 1 > room: a == room
            lo, hi = bisect.bisect_left(self.partial_a, room), bisect.bisect_right(self.partial_a, room)
            out = out + self.partial_ids[lo:hi]
        return out


class Runs:
    """A vocabulary's tables for runs, built as guides reach them and kept (bounded)."""

    def __init__(self, pieces: list[bytes | None]) -> None:
        self.pieces = pieces
        self._scans: dict[bool, list] = {}  # JSON string or plain text -> each token read (scan_chars)
        self._sets: OrderedDict = OrderedDict()  # (json_text, set) -> SetTable
        self._leaving: OrderedDict = OrderedDict()  # (state after a run, set) -> Leaving
        self._leaving_ids = 0

    def allowed(self, grammar: Grammar, run: tuple) -> tuple[SetTable, int, list[int]]:
        """At a place in a run (``Grammar.in_run``): the table of its set, how many of its ``ids`` are
        allowed (a prefix), and the other tokens allowed."""
        json_text, cset, room, due, after = run
        table = self._table(json_text, cset)
        leaving = self._leaving.get((after, cset))
        if leaving is None:
            leaving = self._leaving[(after, cset)] = Leaving(grammar, self.pieces, table, after)
            self._leaving_ids += len(leaving.ids) + len(leaving.partial_ids)
            while self._leaving_ids > MAX_LEAVING_IDS and len(self._leaving) > 1:
                old = self._leaving.popitem(last=False)[1]
                self._leaving_ids -= len(old.ids) + len(old.partial_ids)
        else:
            self._leaving.move_to_end((after, cset))
        return table, bisect.bisect_right(table.need, room), leaving.allowed(room, due)

    def warm(self, sets=(ANY,)) -> None:
        """Read the vocabulary now, as a JSON string's text and as plain text, and build the tables
        of ``sets`` (``.`` by default, the commonest run): what the first run met would otherwise
        build on the engine thread (~10-60 ms for a 16k vocabulary, more for larger ones)."""
        for json_text in (True, False):
            for cset in sets:
                self._table(json_text, cset)

    def _table(self, json_text: bool, cset) -> SetTable:
        table = self._sets.get((json_text, cset))
        if table is None:
            scans = self._scans.get(json_text)
            if scans is None:
                scans = self._scans[json_text] = [scan_chars(p, json_text) if p else None for p in self.pieces]
            table = self._sets[(json_text, cset)] = SetTable(self.pieces, scans, cset)
            if len(self._sets) > MAX_SETS:
                self._sets.popitem(last=False)
        else:
            self._sets.move_to_end((json_text, cset))
        return table


def _python_class(cset) -> re.Pattern:
    """A Python pattern matching the longest run of ``cset``'s characters at the start of a text."""
    negated, ranges = cset
    body = "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges)
    if not body:
        return re.compile("(?s:.)*" if negated else "")
    return re.compile(f"[{'^' if negated else ''}{body}]*")
