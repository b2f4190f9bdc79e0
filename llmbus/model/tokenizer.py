"""The tokenizer of a Hugging Face model directory (torch-free: the gateway imports it).

``tokenizer.json`` drives the ``tokenizers`` library; ``tokenizer_config.json`` supplies the
special tokens, ``add_bos_token``/``add_eos_token`` and the chat template, which
``chat_template.jinja`` overrides when present (transformers 5.x saves it there).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import tokenizers

from llmbus.model.chat_template import ChatTemplate

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters -> the bytes they stand for (GPT-2's table: printable Latin-1
    bytes are themselves, the other 68 take the characters from U+0100 on, in order)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, spare = {}, 0x100
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(spare)] = b
            spare += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _decoder_kinds(decoder: dict | None) -> set[str]:
    """The decoder types of a tokenizer.json ``decoder`` (a Sequence's members included)."""
    if not decoder:
        return set()
    kinds = {decoder.get("type")}
    for member in decoder.get("decoders") or ():
        kinds |= _decoder_kinds(member)
    return kinds


def _read_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: dict[str, str | None] | None = None,
                 add_bos_token: bool = False, add_eos_token: bool = False, chat_template: str | None = None) -> None:
        self.backend = backend
        self.special_tokens = {k: (special_tokens or {}).get(k) for k in _SPECIAL_KEYS}
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = ChatTemplate(chat_template) if chat_template else None
        self.bos_token_id = self._id_of("bos_token")
        self.eos_token_id = self._id_of("eos_token")

    def _id_of(self, key: str) -> int | None:
        text = self.special_tokens[key]
        return None if text is None else self.backend.token_to_id(text)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in {root}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ValueError(f"{path}: not a valid tokenizers file ({exc})") from None
        config: dict[str, Any] = {}
        cfg_path = root / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{cfg_path}: not valid JSON ({exc})") from None
        return cls(
            backend,
            special_tokens={k: _token_text(config.get(k)) for k in _SPECIAL_KEYS},
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=_read_template(root, config),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @functools.cached_property
    def _decoders(self) -> set[str]:
        decoder = self.backend.decoder
        return _decoder_kinds(json.loads(decoder.__getstate__())) if decoder is not None else set()

    @functools.cached_property
    def _added(self) -> set[int]:
        return set(self.backend.get_added_tokens_decoder())

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, exactly: where a token splits a multi-byte character,
        ``decode([token_id])`` gives U+FFFD. A byte-level BPE token's characters map back to bytes, a
        byte-fallback token (``<0xE4>``) is its byte, a SentencePiece piece is its text with ``▁`` as
        a space, an added token is its text; any other tokenizer, what ``decode`` makes of it."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary")
        kinds = self._decoders
        if token_id not in self._added:
            if "ByteLevel" in kinds and all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
            if "ByteFallback" in kinds and (m := _BYTE_TOKEN.fullmatch(piece)):
                return bytes([int(m.group(1), 16)])
            if kinds & {"Metaspace", "Replace"}:
                return piece.replace("\u2581", " ").encode("utf-8")
        elif kinds & {"ByteLevel", "ByteFallback", "Metaspace", "Replace"}:
            return piece.encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        # NOTE: encode_batch, not encode: encode holds the GIL for the whole call (seconds for a
        # megabyte prompt, every other coroutine of the gateway stalled); encode_batch releases it
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None and ids[-1:] != [self.eos_token_id]:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any) -> str:
        """Render ``messages`` to the prompt text (special tokens as text; ``encode`` maps them)."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; use a plain completion prompt")
        context = {k: v for k, v in self.special_tokens.items() if v is not None} | variables
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **context)


from llmbus.model.detokenizer import IncrementalDetokenizer  # noqa: E402  (re-exported for the gateway)

__all__ = ["Tokenizer", "IncrementalDetokenizer"]
