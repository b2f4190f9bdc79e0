"""Benchmark datasets, deterministic from a seed, built with the model's own tokenizer.

Every item carries its prompt both as text and as token ids (the ids are the text re-encoded, so
the two agree), the number of output tokens to ask for, and a kind for per-category latencies.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from llmbus.bench.tokens import BenchTokenizer

DATASETS = ("random", "shared-prefix", "mixed", "multi-turn", "code")


@dataclass(frozen=True)
class BenchItem:
    prompt: str
    prompt_token_ids: list[int]
    output_len: int
    kind: str = "default"
    conversation: int | None = None  # multi-turn: turns of one conversation run in order
    turn: int = 0
    messages: list[dict] | None = field(default=None, compare=False)  # chat form, when not one user message

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "prompt_token_ids": self.prompt_token_ids, "output_len": self.output_len,
                "kind": self.kind, "conversation": self.conversation, "turn": self.turn, "messages": self.messages}

    @classmethod
    def from_dict(cls, d: dict) -> "BenchItem":
        return cls(**d)


@dataclass(frozen=True)
class DatasetConfig:
    """One config for every dataset; each uses the fields named in its builder's docstring."""

    name: str = "random"
    num_prompts: int = 64
    seed: int = 0
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    # shared-prefix
    groups: int = 4
    prompts_per_group: int = 8
    system_len: int = 512
    question_len: int = 64
    # mixed
    long_share: float = 0.1
    long_input_len: int = 2048
    long_output_len: int = 16
    # multi-turn
    conversations: int = 8
    turns: int = 4

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; choose one of {', '.join(DATASETS)}")
        positive = ("num_prompts", "input_len", "output_len", "groups", "prompts_per_group", "system_len",
                    "question_len", "long_input_len", "long_output_len", "conversations", "turns")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"dataset {name} must be an integer >= 1, got {v!r}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range ratio must be in [0, 1), got {self.range_ratio}")
        if not 0 <= self.long_share <= 1:
            raise ValueError(f"long share must be in [0, 1], got {self.long_share}")


def _lengths(rng: random.Random, base: int, ratio: float) -> int:
    lo, hi = max(1, int(base * (1 - ratio))), max(1, int(base * (1 + ratio)))
    return rng.randint(lo, hi)


def _random_text(tok: BenchTokenizer, rng: random.Random, n: int) -> tuple[str, list[int]]:
    """Text that re-encodes to exactly (or, rarely, within a token of) n tokens."""
    ids = [rng.choice(tok.text_ids) for _ in range(n)]
    text = tok.decode(ids)
    for _ in range(16):
        ids = tok.encode(text)
        if len(ids) == n:
            break
        if len(ids) > n:
            text = tok.decode(ids[:n])
        else:
            text = tok.decode(ids + [rng.choice(tok.text_ids) for _ in range(n - len(ids))])
    return text, tok.encode(text)


def _item(tok: BenchTokenizer, text: str, output_len: int, **kw) -> BenchItem:
    return BenchItem(prompt=text, prompt_token_ids=tok.encode(text), output_len=output_len, **kw)


def build_random(cfg: DatasetConfig, tok: BenchTokenizer) -> list[BenchItem]:
    """num_prompts, input_len, output_len, range_ratio (lengths uniform in len*(1 -/+ ratio))."""
    rng = random.Random(cfg.seed)
    items = []
    for _ in range(cfg.num_prompts):
        n_in, n_out = _lengths(rng, cfg.input_len, cfg.range_ratio), _lengths(rng, cfg.output_len, cfg.range_ratio)
        text, ids = _random_text(tok, rng, n_in)
        items.append(BenchItem(prompt=text, prompt_token_ids=ids, output_len=n_out))
    return items


def build_shared_prefix(cfg: DatasetConfig, tok: BenchTokenizer) -> list[BenchItem]:
    """groups x prompts_per_group, each group sharing a system_len-token system prompt, plus a
    question_len-token question; output_len. Order shuffled so groups interleave."""
    rng = random.Random(cfg.seed)
    items = []
    for g in range(cfg.groups):
        system, _ = _random_text(tok, rng, cfg.system_len)
        for _ in range(cfg.prompts_per_group):
            question, _ = _random_text(tok, rng, cfg.question_len)
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            items.append(_item(tok, system + "\n" + question, cfg.output_len, kind=f"group{g}", messages=messages))
    rng.shuffle(items)
    return items


def build_mixed(cfg: DatasetConfig, tok: BenchTokenizer) -> list[BenchItem]:
    """num_prompts short chat requests (input_len/output_len, range_ratio) of which a long_share
    are long-prompt requests (long_input_len/long_output_len), at positions drawn from the seed."""
    rng = random.Random(cfg.seed)
    n_long = round(cfg.num_prompts * cfg.long_share)
    long_at = set(rng.sample(range(cfg.num_prompts), n_long))
    items = []
    for i in range(cfg.num_prompts):
        if i in long_at:
            text, ids = _random_text(tok, rng, _lengths(rng, cfg.long_input_len, cfg.range_ratio))
            items.append(BenchItem(text, ids, _lengths(rng, cfg.long_output_len, cfg.range_ratio), kind="long"))
        else:
            text, ids = _random_text(tok, rng, _lengths(rng, cfg.input_len, cfg.range_ratio))
            items.append(BenchItem(text, ids, _lengths(rng, cfg.output_len, cfg.range_ratio), kind="short"))
    return items


def build_multi_turn(cfg: DatasetConfig, tok: BenchTokenizer) -> list[BenchItem]:
    """conversations x turns; each turn adds an input_len-token user message and resends the whole
    history (earlier user messages and output_len-token stand-in assistant replies)."""
    rng = random.Random(cfg.seed)
    items = []
    for c in range(cfg.conversations):
        messages: list[dict] = []
        for t in range(cfg.turns):
            user, _ = _random_text(tok, rng, _lengths(rng, cfg.input_len, cfg.range_ratio))
            messages = messages + [{"role": "user", "content": user}]
            text = "\n".join(m["content"] for m in messages)
            items.append(_item(tok, text, cfg.output_len, kind=f"turn{t}", conversation=c, turn=t, messages=messages))
            # NOTE: the stand-in reply keeps the dataset independent of any server's output.
            reply, _ = _random_text(tok, rng, cfg.output_len)
            messages = messages + [{"role": "assistant", "content": reply}]
    return items


def build_code(cfg: DatasetConfig, tok: BenchTokenizer) -> list[BenchItem]:
    """num_prompts, input_len, output_len, range_ratio: real text to continue, each prompt about
    input_len tokens of a Python standard library file held out from the demo model's training
    (``llmbus.bench.corpus``), from the start of a line (its first line, or a random one: a file
    is drawn, then a line, from the seed), cut at a line's end where one falls within the last
    quarter of the length. Output as random's."""
    from llmbus.bench.corpus import corpus_files, is_held_out

    files = [p for p in corpus_files() if is_held_out(p)]
    if not files:
        raise ValueError("the code dataset reads Python's standard library source, and found none here")
    rng = random.Random(cfg.seed)
    items = []
    while len(items) < cfg.num_prompts:
        n_in, n_out = _lengths(rng, cfg.input_len, cfg.range_ratio), _lengths(rng, cfg.output_len, cfg.range_ratio)
        try:
            lines = rng.choice(files).read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        start = 0 if rng.random() < 0.5 else rng.randrange(len(lines) or 1)
        ids = tok.encode("".join(lines[start:]))
        if len(ids) < n_in:
            continue  # too short a file (or its end): draw another
        text = tok.decode(ids[:n_in])
        cut = text.rfind("\n", 0, len(text))
        if cut > len(text) * 3 // 4:
            text = text[: cut + 1]
        items.append(_item(tok, text, n_out, kind="code"))
    return items


_BUILDERS = {"random": build_random, "shared-prefix": build_shared_prefix, "mixed": build_mixed,
             "multi-turn": build_multi_turn, "code": build_code}


def build_dataset(cfg: DatasetConfig, tok: BenchTokenizer) -> list[BenchItem]:
    return _BUILDERS[cfg.name](cfg, tok)


def sessions(items: list[BenchItem]) -> list[list[BenchItem]]:
    """Units of arrival: each conversation's turns in order, every other item alone."""
    out: list[list[BenchItem]] = []
    by_conv: dict[int, list[BenchItem]] = {}
    for it in items:
        if it.conversation is None:
            out.append([it])
        elif it.conversation in by_conv:
            by_conv[it.conversation].append(it)
        else:
            by_conv[it.conversation] = [it]
            out.append(by_conv[it.conversation])
    for conv in by_conv.values():
        conv.sort(key=lambda it: it.turn)
    return out
