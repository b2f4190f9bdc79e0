"""Streaming detokenization: new complete text per batch of generated tokens (torch-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmbus.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``add(new ids)`` returns only text that is complete; the pieces concatenate to
    ``tokenizer.decode(generated ids)``.

    It decodes a short window of ids twice: up to what was already emitted (``read``) and up to
    now, and emits the difference. The window starts a few prompt tokens back so decoders that
    treat a leading space specially see real context.
    NOTE: text that ends in U+FFFD is held back: a byte-level token that splits a multi-byte
    UTF-8 character decodes to U+FFFD until the character's last byte arrives. ``finish()``
    releases whatever is held (a sequence that really ends mid-character).
    """

    def __init__(self, tokenizer: "Tokenizer", prompt_ids: list[int], *, skip_special_tokens: bool = True,
                 context: int = 4) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-context:]) if context else []
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        if len(now) <= len(before) or now.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before):]

    def start_of(self, token_id: int) -> int:
        """Where the text of ``token_id``, added next, starts, in characters after the text emitted
        so far: past the held ids' text that stays as it is with it. A token completing a split
        character starts where that character does; one after bytes that can never complete one
        (a lone continuation byte, shown as U+FFFD) starts after that U+FFFD."""
        if self._read == len(self._ids):
            return 0
        before = self._decode(self._ids[self._prefix:self._read])
        held = self._decode(self._ids[self._prefix:])[len(before):]
        after = self._decode(self._ids[self._prefix:] + [token_id])[len(before):].rstrip(_REPLACEMENT)
        n = 0
        while n < min(len(held), len(after)) and held[n] == after[n]:
            n += 1
        return n

    def finish(self) -> str:
        """Everything not yet emitted, incomplete characters included."""
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return now[len(before):] if len(now) > len(before) else ""
