"""JSON Schema ``pattern``: a regular expression compiled to an NFA over code points.

The subset every schema generator emits and a decoder can enforce: literals and escapes (``\\d \\w
\\s \\D \\W \\S``, ``\\n \\t \\r \\f \\v``, ``\\uXXXX``, ``\\xHH``, escaped punctuation), ``.``, classes
``[a-z_]`` / ``[^...]``, groups ``(...)`` and ``(?:...)``, alternation, the quantifiers ``* + ?
{n} {n,} {n,m}`` (a lazy ``?`` after one changes nothing here: the whole string must match either
way), ``^`` at the start and ``$`` at the end. As JSON Schema says, a pattern is searched, not
anchored: without ``^`` anything may come before the match, without ``$`` anything after.
Backreferences, lookaround and ``\\b`` cannot be decided one character at a time: ``RegexError``.
``\\d``, ``\\w`` are ASCII, as in ECMA-262; ``.`` is any character but a line break.
"""

from __future__ import annotations

MAX_STATES = 4096  # NFA states; a{1000} alone would need 1000
MAX_REPEAT = 256


class RegexError(ValueError):
    pass


# a character set: (negated, ((lo, hi), ...)) over code points
_DIGIT = ((48, 57),)
_WORD = ((48, 57), (65, 90), (95, 95), (97, 122))
_SPACE = ((9, 13), (32, 32), (160, 160), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))  # fmt: skip
_CLASSES = {"d": (False, _DIGIT), "D": (True, _DIGIT), "w": (False, _WORD), "W": (True, _WORD),
            "s": (False, _SPACE), "S": (True, _SPACE)}  # fmt: skip
_CONTROL = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "0": 0}
ANY = (True, ((10, 10), (13, 13), (0x2028, 0x2029)))  # "." : not a line terminator
_EVERYTHING = (True, ())


def _member(cset, cp: int) -> bool:
    negated, ranges = cset
    inside = any(lo <= cp <= hi for lo, hi in ranges)
    return inside != negated


class _Parser:
    """Recursive descent to a tree: ("cat", [..]) ("alt", [..]) ("rep", node, lo, hi) ("set", cset)."""

    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0

    def error(self, what: str) -> RegexError:
        return RegexError(f"pattern {self.text!r}: {what} (at {self.i})")

    def peek(self) -> str | None:
        return self.text[self.i] if self.i < len(self.text) else None

    def take(self) -> str:
        c = self.text[self.i]
        self.i += 1
        return c

    def alternation(self):
        options = [self.sequence()]
        while self.peek() == "|":
            self.take()
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self):
        items = []
        while (c := self.peek()) is not None and c not in "|)":
            if c in "^$":
                raise self.error(f"'{c}' is supported only at the very start or end")
            items.append(self.quantified(self.atom()))
        return ("cat", items)

    def quantified(self, node):
        c = self.peek()
        if c is None or c not in "*+?{":
            return node
        if c == "{":
            close = self.text.find("}", self.i)
            body = self.text[self.i + 1 : close] if close > 0 else ""
            lo_s, comma, hi_s = body.partition(",")
            if not lo_s.isdigit() or (hi_s and not hi_s.isdigit()):
                return node  # NOTE: as in ECMA-262 (annex B), a brace that is no quantifier is itself
            self.i = close + 1
            lo, hi = int(lo_s), (int(hi_s) if hi_s else None) if comma else int(lo_s)
            if hi is not None and hi < lo:
                raise self.error(f"{{{body}}}: the maximum is below the minimum")
            if max(lo, hi or 0) > MAX_REPEAT:
                raise self.error(f"{{{body}}}: at most {MAX_REPEAT} repetitions")
        else:
            self.take()
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if self.peek() == "?":  # lazy: the same strings match
            self.take()
        if self.peek() is not None and self.peek() in "*+?":
            raise self.error("a quantifier cannot follow another")
        return ("rep", node, lo, hi)

    def atom(self):
        c = self.take()
        if c == "(":
            if self.text.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.error("lookaround and named groups are not supported")
            inner = self.alternation()
            if self.peek() != ")":
                raise self.error("unclosed group")
            self.take()
            return inner
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", ANY)
        if c == "\\":
            return ("set", self.escape(in_class=False))
        if c in "*+?":
            raise self.error(f"nothing to repeat before '{c}'")
        if c == ")":
            raise self.error("unbalanced ')'")
        return ("set", (False, ((ord(c), ord(c)),)))

    def escape(self, in_class: bool):
        if self.peek() is None:
            raise self.error("a trailing backslash")
        c = self.take()
        if c in _CLASSES:
            return _CLASSES[c]
        if c in _CONTROL:
            cp = _CONTROL[c]
        elif c in "ux":
            n = 4 if c == "u" else 2
            digits = self.text[self.i : self.i + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{c} needs {n} hex digits")
            self.i += n
            cp = int(digits, 16)
        elif c == "b" and in_class:
            cp = 8
        elif c.isalnum():
            raise self.error(f"'\\{c}' is not supported (backreferences, \\b and the like cannot be "
                             "decided one character at a time)")
        else:
            cp = ord(c)
        return (False, ((cp, cp),))

    def class_item(self):
        """One member of a class: a character or a class escape, as a set."""
        c = self.take()
        return self.escape(in_class=True) if c == "\\" else (False, ((ord(c), ord(c)),))

    def char_class(self):
        negated = self.peek() == "^"
        if negated:
            self.take()
        ranges: list[tuple[int, int]] = []
        parts: list = []  # class escapes inside (\d, \W, ...): sets of their own, no range ends
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unclosed '['")
            if c == "]" and not first:
                self.take()
                break
            first = False
            item = self.class_item()
            lo = _single(item)
            if lo is None:
                parts.append(item)
                continue
            hi = lo
            if self.peek() == "-" and self.text[self.i + 1 : self.i + 2] not in ("]", ""):
                self.take()
                hi = _single(self.class_item())
                if hi is None or hi < lo:
                    raise self.error("a bad range in a class")
            ranges.append((lo, hi))
        ranges = _union(ranges, *[_complement(p[1]) if p[0] else p[1] for p in parts])
        return (negated, tuple(ranges))


def _single(cset) -> int | None:
    """The code point of a set holding exactly one, else None."""
    negated, ranges = cset
    return ranges[0][0] if not negated and len(ranges) == 1 and ranges[0][0] == ranges[0][1] else None


def meets(cset, lo: int, hi: int) -> bool:
    """Whether a character set holds some code point in lo..hi."""
    negated, ranges = cset
    if not negated:
        return any(a <= hi and lo <= b for a, b in ranges)
    at = lo  # negated: some point of lo..hi that no range covers
    for a, b in _union(ranges):
        if a > at:
            break
        at = max(at, b + 1)
    return at <= hi


def _overlap(a, b) -> bool:
    """Whether two character sets share a code point."""
    negated, ranges = a
    return any(meets(b, lo, hi) for lo, hi in (_complement(ranges) if negated else ranges))


def _everything(cset) -> bool:
    negated, ranges = cset
    return not ranges if negated else not _complement(ranges)


def _union(*groups) -> list[tuple[int, int]]:
    spans = sorted(r for g in groups for r in g)
    out: list[tuple[int, int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges) -> list[tuple[int, int]]:
    out, at = [], 0
    for lo, hi in _union(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= 0x10FFFF:
        out.append((at, 0x10FFFF))
    return out


class Regex:
    """An NFA: ``initial`` is a frozenset of states, ``step`` one code point, ``accepts``.

    Thompson's construction: each state has at most a character set to one next state, or
    epsilon moves; sets of states are kept closed under epsilon moves, and a set holding a state
    from which any text matches is that state's closure alone (``anything``).
    """

    def __init__(self, pattern: str, whole: bool = False) -> None:
        """``whole``: the text must match all of it (vLLM's guided_regex), not contain a match."""
        text = pattern
        head = text.startswith("^") or whole
        slashes = len(text[:-1]) - len(text[:-1].rstrip("\\"))
        tail = (text.endswith("$") and slashes % 2 == 0) or whole  # NOTE: an even run of backslashes escapes nothing
        body = text[1 if text.startswith("^") else 0 : len(text) - 1 if text.endswith("$") and slashes % 2 == 0 else len(text)]
        parser = _Parser(body)
        tree = parser.alternation()
        if parser.i != len(body):
            raise parser.error("unbalanced ')'")
        any_run = ("rep", ("set", _EVERYTHING), 0, None)
        tree = ("cat", ([] if head else [any_run]) + [tree] + ([] if tail else [any_run]))
        self.pattern = pattern
        self.sets: list = []  # state -> charset or None
        self.next: list[int] = []  # state -> next state on its set
        self.eps: list[list[int]] = []
        # a counted run of one set (x{n,m}): each place in it -> (set, n, m, characters taken, its end)
        self.places: dict[int, tuple] = {}
        start = self._state()
        end = self._build(tree, start)
        self.final = end
        self._memo: dict = {}
        # NOTE: a move only into a state from which the end can still be reached: a branch that can
        # never match ("a[^\s\S]") must not let its first characters out
        self.live = self._live()
        # NOTE: from a state that loops on every character with the end in reach (an unanchored
        # pattern's trailing run) any text matches, so a set holding one steps as that state alone
        # does: state sets keep only it, and a pattern that has matched stops changing state
        self.anything = frozenset(s for s, cset in enumerate(self.sets) if cset is not None and _everything(cset)
                                  and {s, self.final} <= self._close({self.next[s]}) and self.final in self._close({s}))
        self.initial = self._settle(self._close({start}))
        if not self.initial & self.live:
            raise RegexError(f"pattern {pattern!r} matches no text")

    def _live(self) -> frozenset:
        """The states from which ``final`` can be reached (over characters that exist as UTF-8)."""
        back: list[list[int]] = [[] for _ in self.sets]
        for s, targets in enumerate(self.eps):
            for t in targets:
                back[t].append(s)
        for s, cset in enumerate(self.sets):
            if cset is not None and (meets(cset, 0, 0xD7FF) or meets(cset, 0xE000, 0x10FFFF)):
                back[self.next[s]].append(s)
        live, todo = set(), [self.final]
        while todo:
            s = todo.pop()
            if s not in live:
                live.add(s)
                todo.extend(back[s])
        return frozenset(live)

    def _state(self) -> int:
        if len(self.sets) >= MAX_STATES:
            raise RegexError(f"pattern {self.pattern!r} is too large: more than {MAX_STATES} states")
        self.sets.append(None)
        self.next.append(-1)
        self.eps.append([])
        return len(self.sets) - 1

    def _build(self, node, start: int) -> int:
        """States for ``node`` entered at ``start``; returns its exit state."""
        kind = node[0]
        if kind == "set":
            end = self._state()
            self.sets[start], self.next[start] = node[1], end
            return end
        if kind == "cat":
            at = start
            for item in node[1]:
                nxt = self._state()
                self.eps[at].append(nxt)
                at = self._build(item, nxt)
            return at
        if kind == "alt":
            end = self._state()
            for option in node[1]:
                entry = self._state()
                self.eps[start].append(entry)
                self.eps[self._build(option, entry)].append(end)
            return end
        _, inner, lo, hi = node
        while inner[0] == "cat" and len(inner[1]) == 1:  # (?:x){n,m} is x{n,m}
            inner = inner[1][0]
        at, places = start, [start]
        for _ in range(lo):
            entry = self._state()
            self.eps[at].append(entry)
            at = self._build(inner, entry)
            places.append(at)
        if hi is None:  # a loop: inner, back to its entry, or on
            entry = self._state()
            self.eps[at].append(entry)
            self.eps[self._build(inner, entry)].append(entry)
            end = self._state()
            self.eps[entry].append(end)
            return end
        end = self._state()
        self.eps[at].append(end)
        for _ in range(hi - lo):
            entry = self._state()
            self.eps[at].append(entry)
            at = self._build(inner, entry)
            places.append(at)
            self.eps[at].append(end)
        if inner[0] == "set":
            for taken, place in enumerate(places):
                self.places[place] = (inner[1], lo, hi, taken, end)
        return end

    def _close(self, states) -> frozenset:
        out, todo = set(), list(states)
        while todo:
            s = todo.pop()
            if s not in out:
                out.add(s)
                todo.extend(self.eps[s])
        return frozenset(out)

    def _settle(self, states: frozenset) -> frozenset:
        """``states``, or where one of them matches any text (``anything``) that one's closure."""
        anything = states & self.anything
        return self._close({min(anything)}) if anything else states

    def step(self, states: frozenset, cp: int) -> frozenset | None:
        key = (states, cp)
        hit = self._memo.get(key, False)
        if hit is False:
            moved = {self.next[s] for s in states
                     if self.sets[s] is not None and self.next[s] in self.live and _member(self.sets[s], cp)}
            hit = self._settle(self._close(moved)) if moved else None
            self._remember(key, hit)
        return hit

    def can_take(self, states: frozenset, lo: int, hi: int) -> bool:
        """Whether some code point in lo..hi can come next (a character still being read)."""
        key = (states, lo, hi)
        hit = self._memo.get(key)
        if hit is None:
            hit = any(self.sets[s] is not None and self.next[s] in self.live and meets(self.sets[s], lo, hi)
                      for s in states)  # fmt: skip
            self._remember(key, hit)
        return hit

    def in_run(self, states: frozenset) -> tuple | None:
        """Where ``states`` step as a place in a counted run of one set does (``x{n,m}``, each place
        otherwise a state set of its own): (the set, characters the run may still take,
        characters due before it may end, the states once it has ended); None where they do not,
        or where the states after the run could take a character of the set too (so where the run
        ends within a text is not known from the text alone)."""
        key = (states, "run")
        hit = self._memo.get(key, False)
        if hit is False:
            hit = None
            core = self._core(states)
            for s in states:
                place = self.places.get(s)
                if place is None or self._core(self._close({s})) != core:
                    continue
                cset, lo, hi, taken, end = place
                after = self._close({end})
                if not any(self.sets[t] is not None and self.next[t] in self.live and _overlap(self.sets[t], cset)
                           for t in after):  # fmt: skip
                    hit = (cset, hi - taken, max(0, lo - taken), after)
                    break
            self._remember(key, hit)
        return hit

    def _core(self, states: frozenset) -> frozenset:
        """What a step, ``can_take`` and ``accepts`` read of ``states``: those that take a
        character into a live state, and the final one."""
        return frozenset(s for s in states
                         if s == self.final or (self.sets[s] is not None and self.next[s] in self.live))

    def _remember(self, key, value) -> None:
        if len(self._memo) > 1 << 16:
            self._memo.clear()
        self._memo[key] = value

    def accepts(self, states: frozenset) -> bool:
        return self.final in states

    def fullmatch(self, text: str) -> bool:
        states = self.initial
        for c in text:
            states = self.step(states, ord(c))
            if states is None:
                return False
        return self.accepts(states)
