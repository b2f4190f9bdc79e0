"""Which tokens a guide allows next: the vocabulary walked as a byte trie against a grammar state.

The vocabulary is kept as its tokens' byte strings in sorted order, so a trie node is a range of
that list (the tokens sharing a prefix) and a walk descends only into bytes the grammar can take
next: from a state expecting ``:``, one step per distinct first byte, not one per token.

Inside a string, where nearly everything may follow and where most of a JSON output's tokens are
drawn, there is no walk: each token was read once, from inside a string, when the index was built
(``scan_string``). A "plain" token (whole characters, no quote, backslash or control byte) needs
only room; one that stays inside needs room for its characters; one that closes the string needs
room, enough characters before the quote (minLength) and a tail that the state after the string
takes, which is checked once per such state. So a bounded string, whose every length is a state
of its own, costs a bisection and a short list per token, not a walk. A pattern's counted run of
one set (``.{0,256}``, ``[a-z]{1,200}``), each place in which is a pattern state of its own, costs
the same (``llmbus.guide.runs``): each token was read once against the set, and what may follow
the run is checked once per run.

Other masks are cached per (spec, state) and shared by every sequence with that guide. Each
sequence's ``GuideRun`` advances its state by the tokens it has produced since the last step, so
prefill, decode and a recomputed sequence all rebuild the same state from the output alone.
"""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict

import torch

from llmbus.guide.grammar import Grammar, compile_guide, plain_text, scan_string
from llmbus.guide.runs import Runs

log = logging.getLogger(__name__)


class _Sorted:
    def __init__(self, entries: list[tuple[bytes, int]]) -> None:
        entries.sort()
        self.pieces = [p for p, _ in entries]
        self.ids = [i for _, i in entries]


class TokenIndex:
    """A vocabulary for guided decoding: ``pieces[i]`` is token i's bytes, or None for a token a
    guide never produces (special tokens; EOS is allowed separately, where the grammar may end)."""

    def __init__(self, pieces: list[bytes | None]) -> None:
        self.pieces = pieces
        entries = [(p, i) for i, p in enumerate(pieces) if p]
        self.all = _Sorted(list(entries))
        # plain tokens by their length in characters; the others, read from inside a string: those
        # that stay inside by the room they need, those that close it with what they need and what
        # follows the quote
        plain, inside, self.closers = [], [], []
        for p, i in entries:
            if (text := plain_text(p)) is not None:
                plain.append((len(text), i))
            elif (scan := scan_string(p)) is not None:
                need, done, tail = scan
                if tail is None:
                    inside.append((need, i))
                else:
                    self.closers.append((i, need, done, tail))
        plain.sort()
        self.plain_chars = [n for n, _ in plain]  # ascending
        self.plain_ids = [i for _, i in plain]
        inside.sort()
        self.inside_need = [n for n, _ in inside]
        self.inside_ids = [i for _, i in inside]
        self._closing: OrderedDict = OrderedDict()  # state after a string closes -> closers it takes
        self._nodes: dict[tuple[int, int], tuple] = {}  # (first token, depth) -> trie node (top levels)
        self.runs = Runs(pieces)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "TokenIndex":
        specials = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
        return cls([None if i in specials else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)])

    def allowed(self, grammar: Grammar, state: frozenset) -> list[int]:
        """The tokens whose bytes ``state`` can take next, in no particular order."""
        threads = grammar.string_threads(state)
        if threads is not None:
            plain, other = self.in_string(grammar, threads)
            return self.plain_ids[:plain] + other
        place = grammar.in_run(state)
        if place is not None:
            table, stay, other = self.runs.allowed(grammar, place)
            return table.ids[:stay] + other
        out: list[int] = []
        self._walk(grammar, state, 0, len(self.all.pieces), 0, out)
        return out

    def in_string(self, grammar: Grammar, threads: list[tuple[float, int, frozenset]]) -> tuple[int, list[int]]:
        """Inside a string (``Grammar.string_threads``): how many of ``plain_ids`` are allowed (a
        prefix: those short enough), and the other tokens allowed. No walk: a plain token needs
        only room, one that stays inside only room, one that closes the string room, enough
        characters before the quote, and a tail the closed state takes (cached per that state)."""
        room = max(t[0] for t in threads)
        plain = bisect.bisect_right(self.plain_chars, room)
        other = self.inside_ids[: bisect.bisect_right(self.inside_need, room)]
        closing = []
        for room_t, due, after in threads:
            closing += [i for i, need, done in self._closers(grammar, after) if need <= room_t and done >= due]
        return plain, other + (closing if len(threads) == 1 else list(dict.fromkeys(closing)))

    def _closers(self, grammar: Grammar, after: frozenset) -> list[tuple[int, int, int]]:
        hit = self._closing.get(after)
        if hit is None:
            hit = [(i, need, done) for i, need, done, tail in self.closers
                   if not tail or grammar.advance(after, tail) is not None]  # fmt: skip
            self._closing[after] = hit
            if len(self._closing) > 4096:
                self._closing.popitem(last=False)
        return hit

    def _walk(self, grammar: Grammar, state, lo: int, hi: int, depth: int, out: list[int]) -> None:
        """Tokens lo:hi (sorted) share their first ``depth`` bytes, after which the grammar is in
        ``state``: collect those it allows. Outside strings and keys only a few bytes can ever come
        next (``possible_bytes``); the others are not even tried."""
        if depth and (room := grammar.digit_room(state)) is not None:  # inside a number's digits
            self._flat(grammar, state, room, lo, hi, depth, out)
            return
        ends, children = self._node(lo, hi, depth)
        out.extend(self.all.ids[lo:ends])
        only = grammar.possible_bytes(state)
        for b, start, end in children:
            if only is not None and b not in only:
                continue
            nxt = grammar.step(state, b)
            if nxt is not None:
                self._walk(grammar, nxt, start, end, depth + 1, out)

    def _flat(self, grammar: Grammar, state, room: int, lo: int, hi: int, depth: int, out: list[int]) -> None:
        """The tokens of a walk's node one by one, where the state is in a number's digits (a
        digit-led range, tens of tokens): the rest of one all digits needs only room (a number of
        digit tokens would each cost a step per byte), any other is fed to the grammar."""
        pieces, ids = self.all.pieces, self.all.ids
        for j in range(lo, hi):
            rest = pieces[j][depth:]
            if not rest or (len(rest) <= room if rest.isdigit() else grammar.advance(state, rest) is not None):
                out.append(ids[j])

    def _node(self, lo: int, hi: int, depth: int) -> tuple[int, tuple[tuple[int, int, int], ...]]:
        """A trie node, tokens lo:hi sharing ``depth`` bytes: where those ending there end, and its
        children as (byte, start, end). The top two levels, which every walk visits, are kept."""
        key = (lo, depth)
        node = self._nodes.get(key)
        if node is not None:
            return node
        pieces = self.all.pieces
        i = lo
        while i < hi and len(pieces[i]) == depth:  # shorter sorts first
            i += 1
        ends, children = i, []
        while i < hi:
            b = pieces[i][depth]
            end = bisect.bisect_left(pieces, pieces[i][:depth] + bytes((b + 1,)), i, hi) if b < 255 else hi
            children.append((b, i, end))
            i = end
        node = (ends, tuple(children))
        if depth < 2:
            self._nodes[key] = node
        return node


class GuideRun:
    """One sequence's place in its guide: the state after the output tokens seen so far."""

    __slots__ = ("spec", "grammar", "state", "consumed")

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.grammar = compile_guide(spec)
        self.state: frozenset | None = self.grammar.initial
        self.consumed = 0


class GuideMasks:
    """The guided-decoding side of a sampler: per-sequence runs and the shared mask cache."""

    # masks kept, counted in token ids (8 bytes each: 32 MiB): a structural state's mask is short
    # (tens to thousands of ids), and a schema's requests visit thousands of such states
    MASK_IDS = 1 << 22

    def __init__(self, index: TokenIndex) -> None:
        self.index = index
        self._masks: OrderedDict = OrderedDict()  # (spec, state) -> (allowed ids tensor, accepts)
        self._mask_ids = 0
        self._plain_ids: dict[torch.device, torch.Tensor] = {}

    def _plain(self, device: torch.device) -> torch.Tensor:
        cached = self._plain_ids.get(device)
        if cached is None:
            cached = self._plain_ids[device] = torch.tensor(self.index.plain_ids, dtype=torch.long).to(device)
        return cached

    def advance(self, run: GuideRun, output: list[int], eos: set[int]) -> None:
        """Feed ``run`` the output tokens it has not seen (EOS ends the output: it feeds nothing)."""
        for token in output[run.consumed:]:
            if run.state is not None and token not in eos:
                piece = self.index.pieces[token] if token < len(self.index.pieces) else None
                run.state = run.grammar.advance(run.state, piece) if piece else None
        run.consumed = len(output)

    def mask(self, run: GuideRun, device: torch.device) -> tuple[torch.Tensor, bool]:
        """(the ids allowed next, whether the output may end here) for ``run``'s state. A state
        with nothing allowed (a token outside the grammar, which only a bug produces) may only end."""
        if run.state is None:
            return torch.empty(0, dtype=torch.long, device=device), True
        threads = run.grammar.string_threads(run.state)
        if threads is not None:  # inside a string: cheap enough to build every time, no cache entry
            plain, other = self.index.in_string(run.grammar, threads)
            return torch.cat([self._plain(device)[:plain], torch.tensor(other, dtype=torch.long).to(device)]), False
        place = run.grammar.in_run(run.state)
        if place is not None:  # in a counted run of one set: as cheap, no cache entry either
            table, stay, other = self.index.runs.allowed(run.grammar, place)
            if device not in table.tensors:
                table.tensors[device] = torch.tensor(table.ids, dtype=torch.long).to(device)
            ids = torch.cat([table.tensors[device][:stay], torch.tensor(other, dtype=torch.long).to(device)])
            return ids, run.grammar.accepts(run.state) or not ids.numel()
        key = (run.spec, run.state)
        hit = self._masks.get(key)
        if hit is not None and hit[0].device == device:
            self._masks.move_to_end(key)
            return hit
        ids = self.index.allowed(run.grammar, run.state)
        accepts = run.grammar.accepts(run.state) or not ids
        entry = (torch.tensor(ids, dtype=torch.long).to(device), accepts)
        self._masks[key] = entry
        self._mask_ids += entry[0].numel()
        while self._mask_ids > self.MASK_IDS and len(self._masks) > 1:
            self._mask_ids -= self._masks.popitem(last=False)[1][0].numel()
        return entry
