"""Demo models: determinism, sizes, the trained tokenizer, the chat template, streaming detokenization."""

from __future__ import annotations

import argparse
import hashlib
import random
import subprocess
import sys

import pytest
import transformers

from llmbus.model.cli import register
from llmbus.model.config import ModelConfig
from llmbus.model.demo import DEMO_SIZES, _base_config, ensure_demo_model, make_demo_model, write_random_model
from llmbus.model.demo_tokenizer import corpus
from llmbus.model.loader import load_model
from llmbus.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.model_factory import PagedDriver

TEXTS = [
    "Hello, world! The cache holds 16 tokens per block.",
    "  leading and trailing spaces, tabs\tand\nnewlines  ",
    "中文分词测试：你好，世界。日本語のテキストも。한국어도",
    "emoji 🤖🚀 family 👨‍👩‍👧 flag 🇯🇵 and skin tone 👍🏽",
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # code ü ß é ñ",
    "\x00\x07 control bytes and U+FFFF \uffff and a lone 𝔘",
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("demo") / "small", "small")


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return Tokenizer.from_dir(demo_dir)


def _digests(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_generation_is_byte_for_byte_deterministic(demo_dir, tmp_path):
    again = make_demo_model(tmp_path / "again", "small")
    assert _digests(again) == _digests(demo_dir)
    assert set(_digests(demo_dir)) == {"config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"}
    other = write_random_model(tmp_path / "seed1", DEMO_SIZES["small"], seed=1)
    assert _digests(other)["model.safetensors"] != _digests(demo_dir)["model.safetensors"]
    assert _digests(other)["tokenizer.json"] == _digests(demo_dir)["tokenizer.json"]


def test_demo_sizes():
    small = ModelConfig.from_dict(_base_config("llama") | DEMO_SIZES["small"])
    large = ModelConfig.from_dict(_base_config("llama") | DEMO_SIZES["large"])
    assert 1_000_000 < small.num_params < 5_000_000
    assert 90_000_000 < large.num_params < 110_000_000
    assert large.num_attention_heads // large.num_key_value_heads == 3 and large.dtype == "bfloat16"


def test_tokenizer_round_trips_any_text(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode("the model the cache the token")) < len("the model the cache the token") / 2


def test_tokenizer_matches_transformers(demo_dir, tokenizer):
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(demo_dir)
    messages = [{"role": "user", "content": "Hi 你好 🤖"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "More?"}]
    for gen in (True, False):
        ours = tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
        assert ours == hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    for text in TEXTS + [ours]:
        assert tokenizer.encode(text) == hf.encode(text)
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == hf.decode(hf.encode(text))
    assert tokenizer.eos_token_id == hf.eos_token_id


def test_encoding_lets_other_threads_run(tokenizer):
    """The gateway tokenizes in a worker thread so its event loop goes on serving; that is only
    so if the encode releases the GIL (``tokenizers``' ``encode`` holds it for the whole call, its
    ``encode_batch`` does not). A thread that counts while a large text is encoded must count."""
    import threading

    text = "the model the cache the token 你好 " * 15_000
    encoding, done, ticks = threading.Event(), threading.Event(), []

    def count():
        while not done.is_set():
            if encoding.is_set():
                ticks.append(1)
            threading.Event().wait(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    try:
        encoding.set()
        ids = tokenizer.encode(text)
        encoding.clear()
    finally:
        done.set()
        counter.join()
    assert ids == tokenizer.backend.encode(text).ids
    assert len(ticks) >= 20  # (holding the GIL: 2)


def test_chat_template_renders_chatml(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text)
    im_start = tokenizer.token_to_id("<|im_start|>")
    assert ids.count(im_start) == 3 and ids[0] == im_start
    assert tokenizer.decode(ids) == "system\nBe brief.\nuser\n2+2?\nassistant\n"


def test_chat_template_errors_are_value_errors(demo_dir):
    bad = Tokenizer.from_dir(demo_dir)
    with pytest.raises(ValueError, match="non-empty list"):
        bad.apply_chat_template("hello")
    with pytest.raises(ValueError, match=r"messages\[1\] needs a string 'role'"):
        bad.apply_chat_template([{"role": "user", "content": "a"}, {"content": "b"}])
    strict = Tokenizer(bad.backend, chat_template="{% if messages[0]['role'] != 'user' %}"
                                                  "{{ raise_exception('first message must be from the user') }}{% endif %}ok")
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="first message must be from the user"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer(bad.backend, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(bad.backend).apply_chat_template([{"role": "user", "content": "x"}])


def test_incremental_detokenizer_never_splits_characters(tokenizer):
    text = "答案是：猫🐱和狗🐶都很可爱！ Emoji 🧑‍🚀 done. 漢字テスト"
    ids = tokenizer.encode(text)
    split = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert split, "the test needs byte-level tokens that split a character"
    prompt = tokenizer.encode("User says: 你")
    rng = random.Random(0)
    for group in (1, 2, None):
        detok, pieces, pos = IncrementalDetokenizer(tokenizer, prompt), [], 0
        while pos < len(ids):
            n = group or rng.randint(1, 4)
            pieces.append(detok.add(ids[pos:pos + n]))
            pos += n
        pieces.append(detok.finish())
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == tokenizer.decode(ids) == text


def test_incremental_detokenizer_skips_special_tokens_and_flushes(tokenizer):
    im_end = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("ok 🐱")
    detok = IncrementalDetokenizer(tokenizer, [])
    out = "".join(detok.add([i]) for i in ids[:-1])  # stop mid-character
    out += detok.add([im_end]) + detok.finish()
    assert out == tokenizer.decode(ids[:-1] + [im_end])


def test_demo_model_greedy_output_depends_on_the_prompt(demo_dir, tokenizer):
    loaded = load_model(demo_dir)
    assert loaded.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>"))
    prompts = ["Hello there", "def f(x):", "中文", "the cache block", "🤖 robots", "numbers 12345"]
    driver = PagedDriver(loaded.model, num_blocks=16)
    nexts = {int(driver.step([(p, tokenizer.encode(p))])[0][-1].argmax()) for p in prompts}
    assert len(nexts) >= 3


def test_ensure_demo_model_caches_under_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMBUS_DATA_DIR", str(tmp_path))
    path = ensure_demo_model("small")
    assert path == tmp_path / "models" / "demo-small"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model("small") == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="size must be one of"):
        ensure_demo_model("medium")


def test_cli_writes_a_loadable_demo_model(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="llmbus")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["demo-model", "--size", "small", "--out", str(tmp_path / "cli")])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert load_model(tmp_path / "cli").config.num_hidden_layers == DEMO_SIZES["small"]["num_hidden_layers"]
    with pytest.raises(SystemExit):
        parser.parse_args(["demo-model", "--size", "huge"])


def test_demo_model_is_conditioned_like_a_trained_one(demo_dir):
    """Residual projections scaled by 1/sqrt(2 * layers), q/k and embeddings by DEMO_GAINS."""
    from safetensors.torch import load_file

    from llmbus.model.demo import DEMO_GAINS

    w = load_file(str(demo_dir / "model.safetensors"))
    layers = DEMO_SIZES["small"]["num_hidden_layers"]
    std = _base_config("llama")["initializer_range"]
    for name, want in (("model.layers.0.self_attn.o_proj.weight", std / (2 * layers) ** 0.5),
                       ("model.layers.1.mlp.down_proj.weight", std / (2 * layers) ** 0.5),
                       ("model.layers.0.self_attn.q_proj.weight", std * DEMO_GAINS["qk"]),
                       ("model.layers.0.self_attn.v_proj.weight", std),
                       ("model.embed_tokens.weight", std * DEMO_GAINS["embed"])):
        assert abs(float(w[name].float().std()) / want - 1) < 0.05, name


def test_ensure_demo_model_replaces_a_stale_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMBUS_DATA_DIR", str(tmp_path))
    stale = write_random_model(tmp_path / "models" / "demo-small", DEMO_SIZES["small"])  # i.i.d., old init
    old = _digests(stale)["model.safetensors"]
    path = ensure_demo_model("small")
    assert path == stale and _digests(path)["model.safetensors"] != old
    assert _digests(path) == _digests(make_demo_model(tmp_path / "fresh", "small"))


# --- the sentencepiece variant (what llama.cpp's converter accepts) ---

SP_TEXTS = TEXTS + [
    "   three leading, two  inner,\t\ttabs and a trailing run   ", " ", "\n\n\n", "a\u3000b\u00a0c (ideographic, nbsp)",
    "<|im_start|>user\nHi 你好 🤖<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def spm():
    import sentencepiece  # a test extra: llama.cpp's converter needs the SentencePiece variant

    return sentencepiece


@pytest.fixture(scope="module")
def sp_dir(spm, tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("demo-sp") / "small", "small", tokenizer="sentencepiece")


@pytest.fixture(scope="module")
def sp_proc(spm, sp_dir):
    return spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))


def test_sentencepiece_variant_is_deterministic_and_shares_the_weights(sp_dir, demo_dir, tmp_path):
    assert set(_digests(sp_dir)) == set(_digests(demo_dir)) | {"tokenizer.model"}
    assert _digests(make_demo_model(tmp_path / "again", "small", tokenizer="sentencepiece")) == _digests(sp_dir)
    # a fresh process retrains the tokenizer (the in-process result is cached)
    code = ("import hashlib, sys; from llmbus.model.demo_tokenizer import train_sentencepiece as t; "
            "print(hashlib.sha256(t(2048)).hexdigest())")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert fresh == _digests(sp_dir)["tokenizer.model"]
    assert _digests(sp_dir)["model.safetensors"] == _digests(demo_dir)["model.safetensors"]


def test_sentencepiece_vocabulary_and_special_tokens(sp_dir, sp_proc):
    tok = Tokenizer.from_dir(sp_dir)
    assert sp_proc.get_piece_size() == tok.vocab_size == DEMO_SIZES["small"]["vocab_size"]
    assert [sp_proc.id_to_piece(i) for i in range(5)] == ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    assert (sp_proc.unk_id(), sp_proc.bos_id(), sp_proc.eos_id()) == (0, 1, 2)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2) and not tok.add_bos_token
    assert all(tok.id_to_token(i) == sp_proc.id_to_piece(i) for i in range(tok.vocab_size))
    assert sum(sp_proc.is_byte(i) for i in range(tok.vocab_size)) == 256
    assert load_model(sp_dir).eos_token_ids == (4, 2)  # <|im_end|> ends a chat turn, </s> a document


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_token_bytes_spell_the_text_exactly(kind, tokenizer, sp_dir):
    """Tokenizer.token_bytes (logprobs' ``bytes``): each token's own bytes, which decode([id]) loses
    where a token splits a character; a text's tokens' bytes are its UTF-8, special tokens included."""
    tok = tokenizer if kind == "byte-level" else Tokenizer.from_dir(sp_dir)
    split = 0
    for text in SP_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        raws = [tok.token_bytes(i) for i in ids]
        assert b"".join(raws).decode() == tok.decode(ids, skip_special_tokens=False), text
        split += sum(tok.decode([i], skip_special_tokens=False) == "\ufffd" for i in ids)
        for i, raw in zip(ids, raws):
            if raw.decode("utf-8", errors="replace") == raw.decode("utf-8", errors="ignore"):  # whole characters
                assert raw.decode() == tok.decode([i], skip_special_tokens=False) or raw.startswith(b" ")
    assert split > 0  # the texts' CJK and emoji do split
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_bytes(tok.vocab_size + 5)


def test_sentencepiece_tokenizer_encodes_as_sentencepiece_does(sp_dir, sp_proc):
    tok = Tokenizer.from_dir(sp_dir)
    rng = random.Random(0)
    alphabet = " \n\tab the中文🤖é<|>"
    texts = SP_TEXTS + corpus(99, 300) + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))) for _ in range(300)]
    for text in texts:
        assert tok.encode(text) == sp_proc.encode(text), text
        # NOTE: SentencePiece cannot tell a literal "▁" from an escaped space; no text here has one
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == sp_proc.decode(sp_proc.encode(text)) == text
    assert len(tok.encode("the model the cache the token")) < len("the model the cache the token") / 2
    ids = tok.encode("中文 🤖\x00")
    assert sum(sp_proc.is_byte(i) for i in ids) >= 4  # characters outside the vocabulary fall back to bytes
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.encode(chat).count(tok.token_to_id("<|im_start|>")) == 3
    assert tok.decode(tok.encode(chat)) == "system\nYou are a helpful assistant.\nuser\nHi\nassistant\n"


def test_sentencepiece_tokenizer_matches_transformers(sp_dir):
    hf = transformers.AutoTokenizer.from_pretrained(sp_dir)
    tok = Tokenizer.from_dir(sp_dir)
    for text in SP_TEXTS:
        assert hf.encode(text) == tok.encode(text), text
        assert hf.decode(hf.encode(text)) == tok.decode(tok.encode(text), skip_special_tokens=False)
    messages = [{"role": "user", "content": "Hi 你好 🤖"}]
    assert tok.apply_chat_template(messages) == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_sentencepiece_model_matches_transformers_logits(sp_dir):
    import torch

    tok = Tokenizer.from_dir(sp_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "The cache holds 16 tokens per block. 中文 🤖"}]))
    assert len(ids) > 32  # several blocks
    (ours,) = PagedDriver(load_model(sp_dir, dtype="float32").model).step([("a", ids)])
    hf = transformers.LlamaForCausalLM.from_pretrained(sp_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


def test_sentencepiece_cli_and_errors(spm, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LLMBUS_DATA_DIR", str(tmp_path))
    cached = ensure_demo_model("small", tokenizer="sentencepiece")
    assert cached == tmp_path / "models" / "demo-small-sp" and (cached / "tokenizer.model").is_file()
    parser = argparse.ArgumentParser(prog="llmbus")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["demo-model", "--tokenizer", "sentencepiece", "--out", str(tmp_path / "cli")])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "tokenizer.model").is_file()
    with pytest.raises(SystemExit):
        parser.parse_args(["demo-model", "--tokenizer", "wordpiece"])
    with pytest.raises(ValueError, match="demo tokenizer must be one of"):
        make_demo_model(tmp_path / "bad", "small", tokenizer="wordpiece")
    with pytest.raises(ValueError, match="vocab_size=300.*smaller than required_chars"):
        write_random_model(tmp_path / "tiny", {"vocab_size": 300}, tokenizer="sentencepiece")
