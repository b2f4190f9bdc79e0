"""A byte-level BPE tokenizer trained locally on a corpus generated in code (no downloads).

Byte-level pre-tokenization with all 256 byte symbols in the initial alphabet means any text
(CJK, emoji, control characters) encodes without unknown tokens. Same arguments -> same bytes.
"""

from __future__ import annotations

import functools
import json
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

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


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json for the demo tokenizer: ChatML special tokens and template."""
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
