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

    def held_chars(self) -> int:
        """How many whole characters ``add`` is holding back before a split one: where the text of
        the next id starts, when that id completes the split character."""
        if self._read == len(self._ids):
            return 0
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        return max(0, len(now.rstrip(_REPLACEMENT)) - len(before))

    def finish(self) -> str:
        """Everything not yet emitted, incomplete characters included."""
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return now[len(before):] if len(now) > len(before) else ""
