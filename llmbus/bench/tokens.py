"""The model's own tokenizer, as the datasets need it: encode, decode, and which ids are plain text."""

from __future__ import annotations

import os

from tokenizers import Tokenizer


class BenchTokenizer:
    """Wraps `tokenizer.json` from a model directory (the `tokenizers` package, no transformers)."""

    def __init__(self, path: str) -> None:
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json at {path!r}: pass the model directory (or its tokenizer.json)")
        self._tok = Tokenizer.from_file(file)
        special = set(self._tok.get_added_tokens_decoder().keys())
        candidates = [i for i in range(self._tok.get_vocab_size(with_added_tokens=True)) if i not in special]
        texts = self._tok.decode_batch([[i] for i in candidates], skip_special_tokens=True)
        encoded = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        # NOTE: random prompts draw only from ordinary tokens that survive decode -> encode alone
        # (no BOS/EOS/chat markers, no byte fragments), so prompt text re-encodes to its length.
        self.text_ids = [i for i, t, e in zip(candidates, texts, encoded) if t.strip() and e.ids == [i]]
        if not self.text_ids:
            raise ValueError(f"tokenizer at {file!r} has no ordinary (non-special) tokens")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
