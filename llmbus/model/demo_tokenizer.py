"""The demo tokenizers, trained locally on a corpus generated in code (no downloads).

``bpe``: a byte-level BPE (tokenizer.json only). Byte-level pre-tokenization with all 256 byte
symbols in the initial alphabet means any text (CJK, emoji, control characters) encodes without
unknown tokens. ``sentencepiece``: a SentencePiece BPE with byte fallback (tokenizer.model, which
llama.cpp's converter accepts, plus the equivalent tokenizer.json that our loader reads), so any
text encodes too. Same arguments -> same bytes, for both.
"""

from __future__ import annotations

import functools
import io
import json
import random

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

TOKENIZER_KINDS = ("bpe", "sentencepiece")
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# SentencePiece's own control symbols (ids 0, 1, 2), then ChatML's markers as user-defined symbols
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SP_SPECIAL_TOKENS = (UNK, BOS, EOS, IM_START, IM_END)
_SP_SPACE = "\u2581"  # "▁": SentencePiece's escaped space

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no what up out who them some "
    "time could into two then more these can like other than first new very after most also made over did "
    "many before must through years where much your way well down should because each just those people how "
    "good model token request server cache block batch stream queue worker prefix decode prefill attention "
    "layer weight tensor kernel memory latency throughput tenant quota limit route lane deadline abort "
    "hello world python function return import class def self print value list dict string number error"
).split()
_SYLLABLES = ("ka ri to ne sa mo lu vi en or an ul ix pa qu ze ba do fi go he ja ko la ma no pe ro su ta "
              "ve wa yo zu ch th sh st tr pl gr br cl ing ion er ed ly est ness ment").split()
_PUNCT = (".", ",", "!", "?", ";", ":", " -", "...", "\n")
_EMOJI = "😀😂🤖🚀🔥✨👍🎉❤️🌍🍕🐍💡📦⚡️🧠"


def _cjk(rng: random.Random, n: int) -> str:
    return "".join(chr(rng.randint(0x4E00, 0x4FFF)) for _ in range(n))


def _line(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.08:
        return _cjk(rng, rng.randint(2, 12)) + rng.choice(("。", "，", "？", ""))
    if kind < 0.12:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6))) + " " + rng.choice(_EMOJI)
    if kind < 0.2:
        name = rng.choice(_WORDS)
        return f"def {name}_{rng.randint(0, 99)}(x, y={rng.randint(0, 999)}):\n    return x * {rng.random():.3f} + y"
    if kind < 0.4:
        return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(3, 12)))
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
    words[0] = words[0].capitalize()
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 10**rng.randint(1, 6))))
    return " ".join(words) + rng.choice(_PUNCT)


def corpus(seed: int, num_lines: int) -> list[str]:
    """Deterministic pseudo-text: English-like sentences, made-up words, code, numbers, CJK, emoji."""
    rng = random.Random(seed)
    return [_line(rng) for _ in range(num_lines)]


@functools.lru_cache(maxsize=8)
def train_tokenizer_json(vocab_size: int, seed: int = 0) -> str:
    """The tokenizer.json text of a byte-level BPE with about ``vocab_size`` entries (never more)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed, max(2000, vocab_size * 6)), trainer=trainer)
    # NOTE: re-serialise with sorted keys so the bytes never depend on hash-map order.
    return json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=1, sort_keys=True)


@functools.lru_cache(maxsize=8)
def train_sentencepiece(vocab_size: int, seed: int = 0) -> bytes:
    """The tokenizer.model bytes of a SentencePiece BPE with exactly ``vocab_size`` pieces.

    Ids 0-2 are <unk>, <s>, </s>; 3-4 <|im_start|>, <|im_end|> (user-defined: never split, never
    merged); then the 256 byte-fallback pieces <0x00>..<0xFF>. Identity normalization, no dummy
    prefix and no whitespace collapsing, so decode(encode(text)) == text for any text."""
    try:
        import sentencepiece as spm
    except ImportError:
        raise ValueError("the sentencepiece demo tokenizer needs the 'sentencepiece' package "
                         "(pip install sentencepiece)") from None
    out = io.BytesIO()
    # NOTE: one thread, no sampling or shuffling of the corpus, a fixed seed: the trainer's output
    # is then a function of its arguments alone (the tests check the bytes).
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus(seed, max(2000, vocab_size * 6))), model_writer=out,
            model_type="bpe", vocab_size=vocab_size, byte_fallback=True, character_coverage=1.0,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, user_defined_symbols=[IM_START, IM_END],
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, input_sentence_size=0,
            shuffle_input_sentence=False, minloglevel=2)
    except RuntimeError as exc:  # e.g. a vocab_size below the corpus's characters + 261
        raise ValueError(f"cannot train a SentencePiece tokenizer with vocab_size={vocab_size}: {exc}") from None
    return out.getvalue()


def sentencepiece_tokenizer_json(model: bytes) -> str:
    """The tokenizer.json equivalent of a SentencePiece BPE ``model`` (as ``train_sentencepiece``
    makes it): the same vocabulary and ids, merges derived from the piece scores, byte fallback."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    plain = {p: i for i, p in enumerate(pieces) if p not in SP_SPECIAL_TOKENS and not sp.is_byte(i)}
    # NOTE: SentencePiece BPE merges the adjacent pair whose concatenation is the best-scored piece
    # (scores fall as ids rise; ties go leftmost). Every split of a piece into two pieces is a merge,
    # ranked by the merged piece's id; tokenizers' BPE (lowest rank first, leftmost) then agrees.
    merges = sorted((i, plain[p[:k]], plain[p[k:]]) for p, i in plain.items()
                    for k in range(1, len(p)) if p[:k] in plain and p[k:] in plain)
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)},
                               merges=[(pieces[a], pieces[b]) for _, a, b in merges],
                               unk_token=UNK, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", _SP_SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(_SP_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SP_SPECIAL_TOKENS])
    return json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=1, sort_keys=True)


def _added(tokens: tuple[str, ...]) -> dict:
    return {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True} for i, t in enumerate(tokens)}


def tokenizer_config(model_max_length: int, kind: str = "bpe") -> dict:
    """tokenizer_config.json for a demo tokenizer: ChatML special tokens and template.

    ``sentencepiece`` names SentencePiece's <s>/</s>/<unk>, adds no BOS (as ChatML models do) and
    no prefix space: llama.cpp's converter reads both flags, so it tokenizes text as we do."""
    common = {"additional_special_tokens": [IM_START, IM_END], "add_bos_token": False, "add_eos_token": False,
              "chat_template": CHATML_TEMPLATE, "clean_up_tokenization_spaces": False,
              "model_max_length": model_max_length, "tokenizer_class": "PreTrainedTokenizerFast"}
    if kind == "bpe":
        return common | {"added_tokens_decoder": _added(SPECIAL_TOKENS), "bos_token": None, "eos_token": IM_END,
                         "pad_token": ENDOFTEXT, "unk_token": None}
    if kind == "sentencepiece":
        return common | {"added_tokens_decoder": _added(SP_SPECIAL_TOKENS), "bos_token": BOS, "eos_token": EOS,
                         "pad_token": None, "unk_token": UNK, "add_prefix_space": False, "legacy": False}
    raise ValueError(f"demo tokenizer must be one of {list(TOKENIZER_KINDS)}, got {kind!r}")
