"""Which tokens a guide allows next: the vocabulary walked as a byte trie against a grammar state.

The vocabulary is kept as its tokens' byte strings in sorted order, so a trie node is a range of
that list (the tokens sharing a prefix) and a walk descends only into bytes the grammar can take
next: from a state expecting ``:``, one step per distinct first byte, not one per token. Inside an
unbounded string, where nearly everything may follow, the walk covers only the tokens holding a
quote, backslash, control byte or partial UTF-8 character; the rest ("plain") are allowed by their
length alone (all of them in an unbounded string, those that fit in a bounded one).

Masks are cached per (spec, state) and shared by every sequence with that guide, so a schema's
hundredth request computes next to nothing. Each sequence's ``GuideRun`` advances its state by
the tokens it has produced since the last step, so prefill, decode and a recomputed sequence all
rebuild the same state from the output alone.
"""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict

import torch

from llmbus.guide.grammar import Grammar, compile_guide

log = logging.getLogger(__name__)


def _plain(piece: bytes) -> bool:
    """A token that is whole characters of a JSON string's body, no quote, backslash or control."""
    try:
        text = piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(c >= " " and c not in '"\\' for c in text)


class _Sorted:
    def __init__(self, entries: list[tuple[bytes, int]]) -> None:
        entries.sort()
        self.pieces = [p for p, _ in entries]
        self.ids = [i for _, i in entries]


class TokenIndex:
    """A vocabulary for guided decoding: ``pieces[i]`` is token i's bytes, or None for a token a
    guide never produces (special tokens; EOS is allowed separately, where the grammar may end)."""

    def __init__(self, pieces: list[bytes | None]) -> None:
        entries = [(p, i) for i, p in enumerate(pieces) if p]
        self.all = _Sorted(list(entries))
        self.special = _Sorted([(p, i) for p, i in entries if not _plain(p)])
        plain = sorted((len(p.decode("utf-8")), i) for p, i in entries if _plain(p))
        self.plain_chars = [n for n, _ in plain]  # ascending
        self.plain_ids = [i for _, i in plain]

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "TokenIndex":
        specials = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
        return cls([None if i in specials else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)])

    def allowed(self, grammar: Grammar, state: frozenset) -> list[int]:
        """The tokens whose bytes ``state`` can take next, in no particular order."""
        out: list[int] = []
        room = grammar.string_room(state)
        if room is not None:  # plain tokens by length alone; the walk covers the others
            out.extend(self.plain_ids[: bisect.bisect_right(self.plain_chars, room)])
            table = self.special
        else:
            table = self.all
        self._walk(grammar, state, table.pieces, table.ids, 0, len(table.pieces), 0, out)
        return out

    def _walk(self, grammar: Grammar, state, pieces: list[bytes], ids: list[int], lo: int, hi: int,
              depth: int, out: list[int]) -> None:  # fmt: skip
        """pieces[lo:hi] share their first ``depth`` bytes, after which the grammar is in ``state``."""
        i = lo
        while i < hi and len(pieces[i]) == depth:  # these tokens end here (shorter sorts first)
            out.append(ids[i])
            i += 1
        while i < hi:
            b = pieces[i][depth]
            end = bisect.bisect_left(pieces, pieces[i][:depth] + bytes((b + 1,)), i, hi) if b < 255 else hi
            nxt = grammar.step(state, b)
            if nxt is not None:
                self._walk(grammar, nxt, pieces, ids, i, end, depth + 1, out)
            i = end


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

    MAX_MASKS = 2048

    def __init__(self, index: TokenIndex) -> None:
        self.index = index
        self._masks: OrderedDict = OrderedDict()  # (spec, state) -> (allowed ids tensor, accepts)
        self._pieces: dict[int, bytes] = {}

    def _piece(self, token: int) -> bytes | None:
        table = self.index.all
        if not self._pieces:
            self._pieces = dict(zip(table.ids, table.pieces))
        return self._pieces.get(token)

    def advance(self, run: GuideRun, output: list[int], eos: set[int]) -> None:
        """Feed ``run`` the output tokens it has not seen (EOS ends the output: it feeds nothing)."""
        for token in output[run.consumed:]:
            if run.state is not None and token not in eos:
                piece = self._piece(token)
                run.state = run.grammar.advance(run.state, piece) if piece else None
        run.consumed = len(output)

    def mask(self, run: GuideRun, device: torch.device) -> tuple[torch.Tensor, bool]:
        """(the ids allowed next, whether the output may end here) for ``run``'s state. A state
        with nothing allowed (a token outside the grammar, which only a bug produces) may only end."""
        if run.state is None:
            return torch.empty(0, dtype=torch.long, device=device), True
        key = (run.spec, run.state)
        hit = self._masks.get(key)
        if hit is not None and hit[0].device == device:
            self._masks.move_to_end(key)
            return hit
        ids = self.index.allowed(run.grammar, run.state)
        accepts = run.grammar.accepts(run.state) or not ids
        entry = (torch.tensor(sorted(ids), dtype=torch.long).to(device), accepts)
        self._masks[key] = entry
        if len(self._masks) > self.MAX_MASKS:
            self._masks.popitem(last=False)
        return entry
