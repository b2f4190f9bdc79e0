"""Speculative decoding's drafts by n-gram lookup ("prompt lookup decoding"): no draft model.

A decode's text so far often repeats itself: code edited in place, a document quoted or
summarised, a list continued, a loop a small model falls into. So the tokens that followed the
last earlier occurrence of the text's final n-gram are a cheap guess at what comes next. The
engine appends such a draft to the decode's one query token and computes all of them in the same
step, as one-token decode rows sharing the sequence's block table (row ``j`` attends to the
context up to its own position: the keys and values of every row are written before any row's
attention reads them). Each row's logits are sampled as a plain decode's would be (a seeded
request's draw at output ``i`` keyed by ``(seed, i)``), and the step keeps the sampled tokens up
to and including the first that differs from the draft. So the output is distributed exactly
as without drafts (and a greedy or seeded request's tokens are the same, up to the float rounding
of a different batch), while a step may yield up to ``1 + len(draft)`` tokens. The slots of
rejected rows lie past the sequence's computed length and are written again by later steps.

The lookup keeps, per sequence, a map from each n-gram (``min_n <= n <= max_n``) to the position
after its latest occurrence, updated with the tokens each step appends: a draft costs a few dict
lookups, not a scan of the context (a long prompt is indexed a few thousand tokens a step).

A rejected draft token still cost a row of the step, so each sequence's drafts follow how its
last ones fared (``checked``): a draft confirmed whole lets the next one grow by two tokens (up
to ``num_tokens``), one confirmed in part caps the next at one more than it confirmed, and one
rejected from its first token cuts the next to a single token; after ``m`` such misses in a row
the sequence drafts nothing for ``2^(m-1) - 1`` steps (at most 15), so text the lookup cannot
predict costs a few wasted rows, not one every step. Past a few rows a step is compute-bound and a
row pays only for a token likely confirmed: a sequence takes more than an even share of the
step's rows (``propose``'s ``most`` instead of its ``limit``) only while a moving average of how
often its drafted tokens were confirmed stays at ``TRUSTED`` or more (a new sequence starts
there). An untrusted one drafts again only where its step has rows to share: one lone row past a
full group would cost the step as much as the whole group.
"""

from __future__ import annotations

import weakref

from llmbus.engine.sequence import Sequence


MAX_SKIP = 15  # steps without drafts after repeated misses, at most
# tokens indexed a call, at most (a few ms): a long prompt is indexed over several steps, without
# drafts meanwhile, instead of stalling one step for all its batch (32k tokens: ~30 ms at once)
INDEX_PER_CALL = 4096
TRUSTED = 0.85  # a sequence whose drafted tokens are confirmed this often may take more than its share of rows
RATE_WEIGHT = 0.3  # of the last draft in that moving average


class _Index:
    __slots__ = ("upto", "maps", "cap", "misses", "skip", "rate")

    def __init__(self, sizes: range, cap: int) -> None:
        self.upto = 0  # tokens [0, upto) are indexed: each n-gram ending before them maps to where it ended
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.cap = cap  # the next draft's length, at most
        self.misses = 0  # drafts in a row rejected from their first token
        self.skip = 0  # steps left without drafts
        self.rate = TRUSTED  # how often a drafted token is confirmed (moving average; a new sequence is trusted)


class NgramProposer:
    """Drafts of up to ``num_tokens`` tokens, looked up by the sequence's last ``max_n`` down to
    ``min_n`` tokens (the longest suffix that occurred before wins; its latest occurrence)."""

    def __init__(self, num_tokens: int, min_n: int = 2, max_n: int = 4) -> None:
        if num_tokens < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"need num_tokens >= 1 and 1 <= min_n <= max_n, got {num_tokens}, {min_n}, {max_n}")
        self.num_tokens = num_tokens
        self.sizes = range(max_n, min_n - 1, -1)
        self._indexes: weakref.WeakKeyDictionary[Sequence, _Index] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, limit: int | None = None, most: int | None = None) -> list[int]:
        """The draft for ``seq``'s next tokens (at most ``limit``, or ``most`` while its drafts are
        trusted; and its cap); [] when its last n-gram has not occurred before."""
        tokens = _Tokens(seq)
        index = self._index(seq, tokens)
        if index.upto < tokens.end:  # a long context still being indexed
            return []
        if index.skip:
            index.skip -= 1
            return []
        if most is not None and index.rate >= TRUSTED:
            limit = most
        limit = index.cap if limit is None else min(limit, index.cap)
        if limit < 1:
            return []
        end = tokens.end
        for n in self.sizes:
            if n > end:
                continue
            start = index.maps[n].get(tokens.window(end - n, end))
            if start is None:
                continue
            draft = list(tokens.window(start, min(end, start + limit)))
            while len(draft) < limit:  # NOTE: past the end the draft continues from itself (a repeat)
                draft.append(draft[start + len(draft) - end])
            return draft
        return []

    def checked(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A step confirmed ``accepted`` of the ``drafted`` tokens of ``seq``'s draft: size (or
        hold back) its next ones by it."""
        index = self._indexes.get(seq)
        if index is None or drafted < 1:
            return
        # a drafted token's chance, as the tokens tried: those confirmed, and the first rejected
        tried = accepted + (accepted < drafted)
        index.rate += RATE_WEIGHT * (accepted / tried - index.rate)
        if accepted >= drafted:
            index.cap, index.misses = min(self.num_tokens, index.cap + 2), 0
        elif accepted:
            index.cap, index.misses = accepted + 1, 0
        else:
            index.cap, index.misses = 1, index.misses + 1
            index.skip = min(MAX_SKIP, 2 ** (index.misses - 1) - 1)

    def _index(self, seq: Sequence, tokens: "_Tokens") -> _Index:
        """``seq``'s index, extended by up to ``INDEX_PER_CALL`` of the tokens it lacks."""
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = _Index(self.sizes, self.num_tokens)
        upto = min(tokens.end, max(1, index.upto) + INDEX_PER_CALL)
        for i in range(max(1, index.upto), upto):  # the n-grams that end just before token i
            for n, found in index.maps.items():
                if n <= i:
                    found[tokens.window(i - n, i)] = i
        index.upto = max(index.upto, upto)
        return index


class _Tokens:
    """A sequence's prompt and output read as one, without joining them (a long context's copy
    each step would cost more than the lookup)."""

    __slots__ = ("prompt", "output", "end")

    def __init__(self, seq: Sequence) -> None:
        self.prompt, self.output = seq.prompt_token_ids, seq.output_token_ids
        self.end = len(self.prompt) + len(self.output)

    def window(self, a: int, b: int) -> tuple[int, ...]:
        p = len(self.prompt)
        if b <= p:
            return tuple(self.prompt[a:b])
        if a >= p:
            return tuple(self.output[a - p : b - p])
        return tuple(self.prompt[a:]) + tuple(self.output[: b - p])
