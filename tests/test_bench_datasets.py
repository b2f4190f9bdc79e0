"""Datasets: deterministic from a seed, lengths as asked, prompt text and ids agreeing."""

import pytest

from llmbus.bench.datasets import DatasetConfig, build_dataset, sessions
from llmbus.bench.tinymodel import write_tokenizer
from llmbus.bench.tokens import BenchTokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(str(d), vocab_size=400)
    return BenchTokenizer(str(d))


def test_random_lengths_and_text_ids_agree(tok):
    items = build_dataset(DatasetConfig(name="random", num_prompts=12, input_len=40, output_len=9, seed=1), tok)
    assert len(items) == 12
    for it in items:
        assert abs(it.prompt_len - 40) <= 1
        assert it.output_len == 9
        assert tok.encode(it.prompt) == it.prompt_token_ids
        assert not set(it.prompt_token_ids) & {0, 1}  # never the special tokens


def test_range_ratio_bounds(tok):
    items = build_dataset(DatasetConfig(num_prompts=40, input_len=30, output_len=20, range_ratio=0.5, seed=2), tok)
    outs = [it.output_len for it in items]
    assert min(outs) >= 10 and max(outs) <= 30 and len(set(outs)) > 5
    assert all(14 <= it.prompt_len <= 46 for it in items)


@pytest.mark.parametrize("name", ["random", "shared-prefix", "mixed", "multi-turn", "code"])
def test_deterministic_from_seed(tok, name):
    kw = dict(name=name, num_prompts=8, input_len=16, output_len=4, groups=2, prompts_per_group=3, system_len=24,
              question_len=8, long_input_len=64, long_share=0.25, conversations=2, turns=3)
    a = build_dataset(DatasetConfig(seed=5, **kw), tok)
    b = build_dataset(DatasetConfig(seed=5, **kw), tok)
    c = build_dataset(DatasetConfig(seed=6, **kw), tok)
    assert [it.prompt_token_ids for it in a] == [it.prompt_token_ids for it in b]
    assert [it.prompt_token_ids for it in a] != [it.prompt_token_ids for it in c]


def test_code_prompts_are_held_out_standard_library_source(tok):
    from llmbus.bench.corpus import corpus_files, is_held_out

    items = build_dataset(DatasetConfig(name="code", num_prompts=10, input_len=60, output_len=7, seed=3), tok)
    held = [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files() if is_held_out(p)]
    trained = [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files()[:200] if not is_held_out(p)]
    for it in items:
        assert it.kind == "code" and it.output_len == 7
        assert tok.encode(it.prompt) == it.prompt_token_ids
        assert 45 <= it.prompt_len <= 61  # cut at a line's end within the last quarter, or at the length
        assert any(it.prompt in text for text in held)
        assert not any(it.prompt in text for text in trained)


def test_shared_prefix_groups_share_the_system_prompt(tok):
    cfg = DatasetConfig(name="shared-prefix", groups=3, prompts_per_group=4, system_len=32, question_len=8, output_len=5)
    items = build_dataset(cfg, tok)
    assert len(items) == 12
    by_group = {}
    for it in items:
        by_group.setdefault(it.kind, []).append(it)
    assert sorted(len(v) for v in by_group.values()) == [4, 4, 4]
    systems = {g: {it.messages[0]["content"] for it in v} for g, v in by_group.items()}
    assert all(len(s) == 1 for s in systems.values())
    assert len({next(iter(s)) for s in systems.values()}) == 3
    for it in items:
        system = it.messages[0]["content"]
        assert it.prompt.startswith(system)
        assert abs(len(tok.encode(system)) - 32) <= 1


def test_mixed_share_of_long_requests(tok):
    cfg = DatasetConfig(name="mixed", num_prompts=20, input_len=12, output_len=6, long_share=0.25,
                        long_input_len=80, long_output_len=2)
    items = build_dataset(cfg, tok)
    longs = [it for it in items if it.kind == "long"]
    shorts = [it for it in items if it.kind == "short"]
    assert len(longs) == 5 and len(shorts) == 15
    assert all(abs(it.prompt_len - 80) <= 1 and it.output_len == 2 for it in longs)
    assert all(abs(it.prompt_len - 12) <= 1 and it.output_len == 6 for it in shorts)


def test_multi_turn_resends_history_and_groups_into_sessions(tok):
    cfg = DatasetConfig(name="multi-turn", conversations=2, turns=3, input_len=10, output_len=4)
    items = build_dataset(cfg, tok)
    assert len(items) == 6
    units = sessions(items)
    assert len(units) == 2 and all([it.turn for it in u] == [0, 1, 2] for u in units)
    for u in units:
        for prev, cur in zip(u, u[1:]):
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert [m["role"] for m in cur.messages[len(prev.messages):]] == ["assistant", "user"]
            assert cur.prompt_len > prev.prompt_len


@pytest.mark.parametrize("kwargs,match", [
    ({"name": "sharegpt"}, "unknown dataset"), ({"num_prompts": 0}, "num_prompts"),
    ({"range_ratio": 1.0}, "range ratio"), ({"long_share": 1.5}, "long share"), ({"input_len": 2.5}, "input_len"),
])
def test_bad_config_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DatasetConfig(**kwargs)


def test_missing_tokenizer_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        BenchTokenizer(str(tmp_path))
