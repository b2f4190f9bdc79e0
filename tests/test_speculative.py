"""Speculative decoding by n-gram lookup: drafts checked in the same step change nothing a request
gets (greedy output still equals transformers'; seeded draws, stops, max_tokens and logprobs as
without drafts), the cache keeps only confirmed tokens' KV, and nothing leaks."""

from __future__ import annotations

import random

import pytest
import torch

from llmbus.engine.block_manager import BlockManager
from llmbus.engine.config import EngineConfig
from llmbus.engine.engine import Engine
from llmbus.engine.llm import LLM
from llmbus.engine.sampler import Sampler
from llmbus.engine.sampling_params import SamplingParams
from llmbus.engine.scheduler import Scheduler, SchedulerConfig
from llmbus.engine.sequence import Sequence
from llmbus.engine.speculative import NgramProposer
from tests.test_engine import CONFIG, model_dir  # noqa: F401 - fixture
from tests.test_engine import hf_outputs, prompts  # noqa: F401 - fixtures
from tests.model_factory import write_random_model

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _seq(tokens: list[int], out: list[int] = (), **params) -> Sequence:
    return Sequence("s", list(tokens), SamplingParams(**params), output_token_ids=list(out))


# --- the proposer ----------------------------------------------------------------------------


def test_the_draft_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    p = NgramProposer(3, min_n=1, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9
    seq = _seq([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # the suffix [5, 2, 3] never occurred; [2, 3] did, latest at 6-7, followed by 7, 8, 5
    assert p.propose(seq) == [7, 8, 5]
    assert p.propose(seq, limit=2) == [7, 8]
    seq.output_token_ids.append(7)  # indexed as it grows: [3, 7] now ends the text, seen at 7-8
    assert p.propose(seq) == [8, 5, 2]


def test_no_draft_without_an_earlier_occurrence_or_room():
    p = NgramProposer(4, min_n=2, max_n=3)
    assert p.propose(_seq([1, 2, 3, 4, 5])) == []
    assert p.propose(_seq([4, 5, 1, 4, 5]), limit=0) == []
    assert p.propose(_seq([1])) == []


def test_a_draft_past_the_end_of_the_text_repeats_the_loop():
    p = NgramProposer(7, min_n=2, max_n=2)
    # [4, 5] last occurred at 3-4, followed by 6 and then the end: the loop 6, 4, 5 goes on
    assert p.propose(_seq([1, 2, 3, 4, 5, 6, 4, 5])) == [6, 4, 5, 6, 4, 5, 6]


def test_a_long_context_is_indexed_over_several_calls(monkeypatch):
    from llmbus.engine import speculative

    monkeypatch.setattr(speculative, "INDEX_PER_CALL", 4)
    p = NgramProposer(2, min_n=2, max_n=2)
    seq = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2])  # 11 tokens: indexed by the third call
    assert p.propose(seq) == [] and p.propose(seq) == []
    assert p.propose(seq) == [3, 4]


def test_the_proposer_validates_its_sizes():
    with pytest.raises(ValueError):
        NgramProposer(0)
    with pytest.raises(ValueError):
        NgramProposer(2, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="speculative_ngram"):
        EngineConfig(speculative_tokens=2, speculative_ngram=(0, 3))
    with pytest.raises(ValueError, match="speculative_tokens"):
        EngineConfig(speculative_tokens=17)


# --- the scheduler ---------------------------------------------------------------------------


def _decoding(max_tokens: int = 50, max_model_len: int = 256, budget: int = 64, num_blocks: int = 64):
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=max_model_len), bm)
    sched.drafter = lambda seq, shared, most: [7] * shared
    sched.draft_max_rows, sched.draft_row_group = 64, 65
    seq = Sequence("s", [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens))
    sched.add(seq)
    while not seq.output_token_ids:  # the prompt, in chunks of the budget
        out = sched.schedule()
        sched.update(out, {"s": [(9, None)]} if out.scheduled[0].sample else {})
    return sched, bm, seq


def test_a_draft_fits_max_tokens_the_context_and_the_budget():
    for kw, room in [({}, 48), ({"max_tokens": 4}, 2), ({"max_model_len": 9}, 2), ({"budget": 3}, 2)]:
        sched, _, seq = _decoding(**kw)
        entry = sched.schedule().scheduled[0]
        assert (entry.num_new_tokens, len(entry.draft), entry.decodes) == (1 + room, room, True), kw
        assert len(seq.block_table) * 4 >= seq.num_computed_tokens + entry.num_new_tokens


def test_a_draft_whose_blocks_are_not_free_decodes_plainly():
    sched, bm, seq = _decoding(num_blocks=3)  # 12 slots: the prompt and token hold 2 blocks
    entry = sched.schedule().scheduled[0]
    assert entry.draft == () and entry.num_new_tokens == 1
    assert bm.num_free_blocks == 1


def test_update_keeps_the_confirmed_tokens_and_computes_their_inputs():
    sched, bm, seq = _decoding()
    out = sched.schedule()
    assert len(out.scheduled[0].draft) == 50 - 2  # one output so far, one sampled after the draft
    sched.update(out, {"s": [(7, None), (7, None), (3, None)]})  # two drafted 7s confirmed, then a 3
    assert seq.output_token_ids == [9, 7, 7, 3]
    assert seq.num_computed_tokens == seq.num_tokens - 1  # all but the last sampled token
    with pytest.raises(ValueError, match="sampled tokens"):
        out = sched.schedule()
        sched.update(out, {"s": [(7, None)] * (len(out.scheduled[0].draft) + 2)})


def test_drafts_fill_the_last_group_of_rows_then_go_to_trusted_sequences():
    sched, bm, _ = _decoding()
    sched.draft_row_group = 5
    assert len(sched.schedule().scheduled[0].draft) == 4  # one decode: its row and four drafted fill the group
    for rid in "abcdef":
        other = Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=50))
        sched.add(other)
        while not other.output_token_ids:
            out = sched.schedule()
            sched.update(out, {e.seq.request_id: [(9, None)] for e in out.scheduled if e.sample})
    drafts = lambda: {e.seq.request_id: len(e.draft) for e in sched.schedule().scheduled}  # noqa: E731
    sched.draft_row_group = 8  # seven decodes: one row left in the group
    assert drafts() == dict(s=1, a=0, b=0, c=0, d=0, e=0, f=0)
    sched.draft_row_group = 11  # four left: one each while they last
    assert drafts() == dict(s=1, a=1, b=1, c=1, d=0, e=0, f=0)
    sched.draft_row_group = 7  # the group is full: none
    assert set(drafts().values()) == {0}
    # past the group, rows go to the sequences the drafter trusts ("a", "c"), in order, within
    # draft_max_rows (7 decodes + 10 drafted)
    sched.drafter = lambda seq, share, most: [7] * (most if seq.request_id in "ac" else share)
    sched.draft_max_rows = 17
    assert drafts() == dict(s=0, a=10, b=0, c=0, d=0, e=0, f=0)


def test_drafts_follow_how_the_last_ones_fared():
    p = NgramProposer(6, min_n=1, max_n=1)
    seq = _seq([3] * 10)
    assert len(p.propose(seq)) == 6
    p.checked(seq, 6, 2)  # confirmed in part: one more than confirmed next
    assert len(p.propose(seq)) == 3
    p.checked(seq, 3, 3)  # whole: two more
    assert len(p.propose(seq)) == 5
    assert len(p.propose(seq, 1, 4)) == 4  # whole: past its share
    p.checked(seq, 4, 2)
    assert len(p.propose(seq, 1, 4)) == 1  # in part: its share
    p.checked(seq, 1, 1)
    misses = []
    for _ in range(5):  # rejected from the first token, again and again: drafts held back longer
        p.checked(seq, 1, 0)
        steps = 0
        while not p.propose(seq):
            steps += 1
        misses.append(steps)
    assert misses == [0, 1, 3, 7, 15]
    assert len(p.propose(seq)) == 1
    p.checked(seq, 1, 1)
    assert len(p.propose(seq)) == 3


# --- the sampler -----------------------------------------------------------------------------


def test_a_row_ahead_draws_what_its_sequence_would_draw_there():
    """A seeded row ``j`` ahead is keyed as the plain row of a sequence with ``j`` more outputs."""
    torch.manual_seed(0)
    logits = torch.randn(1, 300)
    params = SamplingParams(temperature=1.0, seed=11)
    s = Sampler()
    ahead = s(logits.repeat(3, 1), [_seq([1], [5], **vars_of(params))] * 3, [0, 1, 2]).token_ids
    plain = [s(logits, [_seq([1], [5] * n, **vars_of(params))]).token_ids[0] for n in (1, 2, 3)]
    assert ahead == plain and len(set(ahead)) > 1


def test_rows_ahead_refuse_penalties_and_guides():
    with pytest.raises(ValueError, match="cannot be penalised or guided"):
        Sampler()(torch.zeros(2, 8), [_seq([1], [2], presence_penalty=1.0)] * 2, [0, 1])


def vars_of(params: SamplingParams) -> dict:
    return {"temperature": params.temperature, "seed": params.seed}


# --- the engine ------------------------------------------------------------------------------


def _llm(model_dir, k: int = 4, **kw) -> LLM:  # noqa: F811
    return LLM(model_dir, dtype="float32", device="cpu", speculative_tokens=k, speculative_ngram=(1, 3),
               **{"speculative_max_rows": 64, **kw})


def _repetitive(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase: the drafts find plenty to check."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, CONFIG["vocab_size"]) for _ in range(rng.randrange(3, 9))]
        out.append((phrase * 12)[: rng.randrange(20, 70)])
    return out


def _drafted(llm: LLM) -> tuple[float, float]:
    s = llm.engine.stats
    return s.draft_tokens.values.get((), 0), s.accepted_tokens.values.get((), 0)


def test_greedy_output_equals_transformers_with_drafts(model_dir, prompts, hf_outputs):  # noqa: F811
    llm = _llm(model_dir, max_num_seqs=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=len(hf_outputs[0]), temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_outputs
    drafted, accepted = _drafted(llm)
    assert drafted > 0 and accepted > 0
    assert llm.engine.leak_check()["free_blocks"] == llm.engine.leak_check()["total_blocks"]


@pytest.mark.parametrize("kv_format", ["model", "int8"])
def test_drafts_change_no_token(model_dir, kv_format):  # noqa: F811
    """Greedy, seeded, with stop tokens inside the drafts' loops, at max_tokens, with logprobs:
    the same tokens with drafts as without, and the drafts were used."""
    texts = _repetitive(6)
    cases = [GREEDY,
             SamplingParams(max_tokens=33, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True),
             SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(texts[0][2], texts[1][2])),
             SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True, logprobs=2)]
    plain, spec = _llm(model_dir, 0, kv_format=kv_format), _llm(model_dir, kv_format=kv_format)
    for params in cases:
        want, got = plain.generate(texts, params), spec.generate(texts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], params
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        if params.logprobs is not None:
            for w, g in zip(want, got):
                assert [e.token_id for e in g.logprobs] == g.token_ids
                assert [e.logprob for e in g.logprobs] == pytest.approx([e.logprob for e in w.logprobs], abs=1e-4)
    assert _drafted(spec)[1] > 0
    leaks = spec.engine.leak_check()
    assert leaks["requests"] == 0 and leaks["free_blocks"] == leaks["total_blocks"]


def test_the_cache_keeps_only_confirmed_tokens(model_dir):  # noqa: F811
    """Blocks a drafted run committed hold the KV of the tokens it kept, not of rejected drafts:
    continuing from them gives what a fresh engine computes."""
    spec, fresh = _llm(model_dir, max_num_seqs=2), _llm(model_dir, 0, enable_prefix_caching=False)
    texts = _repetitive(3, seed=1)
    firsts = spec.generate(texts, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    assert _drafted(spec)[0] > _drafted(spec)[1] > 0  # some drafts were rejected
    longer = [p + o.token_ids[:50] for p, o in zip(texts, firsts)]
    cached = spec.generate(longer, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert all(o.num_cached_tokens >= 48 for o in cached)
    want = fresh.generate(longer, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in cached] == [o.token_ids for o in want]


def test_no_drafts_for_penalised_guided_or_int4_requests(model_dir, caplog):  # noqa: F811
    llm = _llm(model_dir)
    llm.generate(_repetitive(2), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, presence_penalty=0.5))
    assert _drafted(llm) == (0, 0)
    engine = Engine.from_model_dir(str(model_dir), EngineConfig(dtype="float32", device="cpu", kv_format="int4",
                                                                speculative_tokens=4))  # fmt: skip
    assert engine.proposer is None and engine.scheduler.drafter is None
    assert "speculative decoding needs a KV format" in caplog.text


def test_engine_metrics_name_the_draft_counters(model_dir):  # noqa: F811
    llm = _llm(model_dir)
    llm.generate(_repetitive(2), GREEDY)
    names = {f.name for f in llm.engine.stats.families()}
    assert {"llmbus_engine_spec_draft_tokens_total", "llmbus_engine_spec_accepted_tokens_total"} <= names
    generated = llm.engine.stats.generation_tokens.values[()]
    assert generated == 2 * GREEDY.max_tokens


@pytest.mark.parametrize("fmt", ["model", "int8"])
def test_drafted_rows_run_on_the_triton_kernels_and_the_recorded_path(tmp_path, monkeypatch, fmt):
    """A draft's rows are decode rows: on the Triton backend (the interpreter here) they take the
    decode kernel and the recorded decode path, with the tokens of the plain run."""
    from tests.test_decode_graphs import _run

    model = write_random_model(tmp_path, {"num_hidden_layers": 2}, seed=7)
    texts = ([([5, 9, 11] * 7)[:19], ([40, 41] * 9)[:17]], (14, 11))
    plain, _, _, _ = _run(model, fmt, True, monkeypatch, max_num_seqs=8, prompts=texts)
    spec, _, llm, runs = _run(model, fmt, True, monkeypatch, max_num_seqs=8, prompts=texts, speculative_tokens=2,
                              speculative_ngram=(1, 2))  # fmt: skip
    assert spec == plain
    assert _drafted(llm)[1] > 0 and max(runs) > 2  # recorded steps with more rows than sequences


@pytest.mark.parametrize("argv, message", [
    (["--speculative-ngram", "4:2"], "--speculative-ngram must be MIN:MAX with 1 <= MIN <= MAX <= 16, got 4:2"),
    (["--speculative-tokens", "-1"], "--speculative-tokens must be between 0 and 16, got -1"),
    (["--speculative-max-rows", "1"], "--speculative-max-rows must be >= 2, got 1"),
])
def test_bad_options_name_the_option(argv, message):
    import argparse

    from llmbus.engine.config import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(ValueError) as err:
        engine_config_from_args(parser.parse_args(argv))
    assert str(err.value) == message
    assert engine_config_from_args(parser.parse_args(["--speculative-ngram", "3"])).speculative_ngram == (3, 3)


def test_only_a_trusted_sequence_drafts_past_its_share_of_rows():
    p = NgramProposer(4, min_n=1, max_n=1)
    seq = _seq([3] * 10)
    assert len(p.propose(seq, 0, 4)) == 4  # a new sequence is trusted with more than its share
    p.checked(seq, 4, 1)  # one token of two tried: no longer
    assert [len(p.propose(seq, 0, 4)) for _ in range(20)] == [0] * 20
    assert len(p.propose(seq, 1, 4)) == 1  # its share, where the step has rows to share
    for _ in range(3):
        p.checked(seq, 1, 1)
    assert len(p.propose(seq, 0, 4)) == 4  # trusted again (and its cap grew)
