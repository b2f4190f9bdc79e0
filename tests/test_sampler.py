"""Sampler against independent references: transformers' logits processors and plain torch."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from llmbus.kernels import cpu_native
from llmbus.engine.sampler import Sampler, apply_penalties, step_seed, warp_logits
from llmbus.engine.sampling_params import SamplingParams
from llmbus.engine.sequence import Sequence

V = 257


def seq(params: SamplingParams, prompt=(1, 2, 3), output=(), rid="r") -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=list(prompt), params=params, output_token_ids=list(output))


def hf_warp(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers in generate()'s order, on one row [1, V]."""
    ids = torch.zeros(1, 1, dtype=torch.long)
    x = TemperatureLogitsWarper(p.temperature)(ids, row)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0.0:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    return x


WARP_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_k=1),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.0, top_p=0.05),
    SamplingParams(temperature=1.1, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=40, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=2.0, top_k=V + 10, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=-1, min_p=0.5),
]


def test_warp_matches_transformers_per_row_in_one_batch():
    torch.manual_seed(0)
    logits = torch.randn(len(WARP_CASES), V) * 3
    logits[0, :20] = float("-inf")  # rows with -inf entries must stay NaN-free
    ours = warp_logits(logits, WARP_CASES)
    for i, p in enumerate(WARP_CASES):
        ref = hf_warp(logits[i : i + 1].clone(), p)[0]
        ref_p, our_p = ref.softmax(-1), ours[i].softmax(-1)
        assert torch.equal(our_p > 0, ref_p > 0), f"kept set differs for {p}"
        torch.testing.assert_close(our_p, ref_p, rtol=1e-5, atol=1e-7)
        assert not torch.isnan(our_p).any()


def test_ties_at_top_k_boundary_are_kept_like_transformers():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]])
    p = SamplingParams(top_k=2)
    ours = warp_logits(logits, [p])
    ref = hf_warp(logits.clone(), p)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    assert torch.isfinite(ours).sum() == 4


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(1)
    logits = torch.randn(3, V) * 2
    seqs = [
        seq(SamplingParams(repetition_penalty=1.3), prompt=[5, 7, 7, 250], output=[9, 5, 300]),
        seq(SamplingParams(repetition_penalty=0.7), prompt=[0, 1, 2], output=[]),
        seq(SamplingParams(repetition_penalty=2.0), prompt=[100], output=[100, 101, 102, 102]),
    ]
    ours = apply_penalties(logits, seqs)
    for i, s in enumerate(seqs):
        proc = RepetitionPenaltyLogitsProcessor(penalty=s.params.repetition_penalty)
        ref = proc(torch.tensor([s.all_token_ids]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(ours[i], ref)
    assert not torch.equal(ours, logits)


def test_presence_and_frequency_penalties_match_a_per_token_loop():
    torch.manual_seed(2)
    logits = torch.randn(2, 50)
    seqs = [
        seq(SamplingParams(presence_penalty=0.5, frequency_penalty=0.3), prompt=[1, 4], output=[4, 4, 9, 49, 4]),
        seq(SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5), prompt=[3], output=[0, 3, 3]),
    ]
    ours = apply_penalties(logits, seqs)
    ref = logits.clone()
    for i, s in enumerate(seqs):
        for tok in set(s.output_token_ids):  # prompt tokens are not penalised here
            n = s.output_token_ids.count(tok)
            ref[i, tok] -= s.params.presence_penalty + s.params.frequency_penalty * n
    torch.testing.assert_close(ours, ref)


def test_greedy_is_argmax_and_penalised_greedy_is_argmax_of_penalised_logits():
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    top = logits.argmax(-1).tolist()
    plain = [seq(SamplingParams(temperature=0.0), rid=f"g{i}") for i in range(4)]
    assert Sampler()(logits, plain).token_ids == top
    # Penalise each row's argmax through its prompt: the winner must move to the runner-up.
    pen = [
        seq(SamplingParams(temperature=0.0, repetition_penalty=50.0), prompt=[top[0]]),
        seq(SamplingParams(temperature=0.0, frequency_penalty=2.0), prompt=[0], output=[top[1]] * 3),
        seq(SamplingParams(temperature=0.0, presence_penalty=2.0), prompt=[0], output=[top[2]]),
        seq(SamplingParams(temperature=0.0), prompt=[top[3]]),
    ]
    got = Sampler()(logits, pen).token_ids
    ref = logits.clone()
    ref[0] = RepetitionPenaltyLogitsProcessor(50.0)(torch.tensor([[top[0]]]), logits[0:1].clone())[0]
    ref[1, top[1]] -= 6.0
    ref[2, top[2]] -= 2.0
    assert got == ref.argmax(-1).tolist()
    assert got[3] == top[3]


@pytest.fixture(params=["native", "torch"])
def sampler_path(request, monkeypatch):
    """Runs a test through the C warp-and-draw and through the torch path (the GPU's, and the CPU's
    without the library): both must honour the same contract."""
    if request.param == "native" and not cpu_native.available():
        pytest.skip("the C library did not build")
    monkeypatch.setenv("LLMBUS_CPU_SAMPLER", request.param)
    return request.param


def _run(sampler: Sampler, target: Sequence, steps: int, companions: int, reverse: bool, gen_seed: int) -> list[int]:
    """Decodes ``target`` for ``steps`` steps beside random companions; returns its tokens."""
    g = torch.Generator().manual_seed(gen_seed)
    for _ in range(steps):
        comp = [
            seq(SamplingParams(temperature=0.8, top_k=10, seed=(k if k % 2 else None)), output=[k] * k, rid=f"c{k}")
            for k in range(companions)
        ]
        batch = [target] + comp
        step = torch.Generator().manual_seed(99 + len(target.output_token_ids))  # logits depend on the step
        rows = [torch.randn(V, generator=step)] + [torch.randn(V, generator=g) for _ in comp]
        if reverse:
            batch, rows = batch[::-1], rows[::-1]
        out = sampler(torch.stack(rows), batch)
        target.output_token_ids.append(out.token_ids[batch.index(target)])
    return list(target.output_token_ids)


@pytest.mark.usefixtures("sampler_path")
def test_seeded_request_is_independent_of_batch_order_and_worker():
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = _run(Sampler(seed=1), seq(params, rid="t"), 25, 0, False, 5)
    batched = _run(Sampler(seed=2), seq(params, rid="t"), 25, 8, False, 6)
    reversed_ = _run(Sampler(), seq(params, rid="t"), 25, 8, True, 7)
    assert alone == batched == reversed_
    # Handoff: a fresh Sampler (another worker) continues a sequence mid-way identically.
    handed = seq(params, rid="t")
    _run(Sampler(seed=3), handed, 10, 3, False, 8)
    assert _run(Sampler(seed=4), handed, 15, 5, True, 9) == alone
    other = _run(Sampler(), seq(SamplingParams(temperature=1.0, top_p=0.95, seed=4321), rid="t"), 25, 0, False, 5)
    assert other != alone


def _check_frequencies(tokens: list[int], probs: torch.Tensor) -> None:
    n = len(tokens)
    freq = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double() / n
    p = probs.double()
    assert (freq[p == 0] == 0).all(), "sampled a token with zero probability"
    se = torch.sqrt(p * (1 - p) / n)
    assert ((freq - p).abs() <= 5 * se + 1e-9).all(), f"max deviation {((freq - p).abs() / (se + 1e-12)).max()} SE"


@pytest.mark.usefixtures("sampler_path")
def test_unseeded_draws_follow_the_warped_distribution():
    torch.manual_seed(4)
    logits = torch.randn(1, 24) * 2
    p = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02)
    n = 20_000
    out = Sampler(seed=0)(logits.expand(n, -1).contiguous(), [seq(p, rid=str(i)) for i in range(n)])
    _check_frequencies(out.token_ids, hf_warp(logits.clone(), p)[0].softmax(-1))


@pytest.mark.usefixtures("sampler_path")
def test_seeded_draws_follow_the_warped_distribution():
    torch.manual_seed(5)
    logits = torch.randn(1, 16)
    p = dict(temperature=1.2, top_p=0.85)
    n = 3_000
    seqs = [seq(SamplingParams(seed=s, **p), rid=str(s)) for s in range(n)]
    out = Sampler()(logits.expand(n, -1).contiguous(), seqs)
    _check_frequencies(out.token_ids, hf_warp(logits.clone(), SamplingParams(**p))[0].softmax(-1))


def test_logprobs_are_log_softmax_of_raw_logits():
    torch.manual_seed(6)
    logits = torch.randn(4, V)
    logits[1, 10:] = float("-inf")
    top0 = int(logits[0].argmax())  # penalised, so penalised logprobs would differ from raw ones
    seqs = [
        seq(SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.5, logprobs=5), prompt=[top0, 1]),
        seq(SamplingParams(temperature=1.0, logprobs=20)),
        seq(SamplingParams(temperature=0.0, logprobs=0)),
        seq(SamplingParams(temperature=1.0)),
    ]
    out = Sampler(seed=0)(logits, seqs)
    ref = torch.log_softmax(logits.double(), -1)
    for i, n in enumerate([5, 20, 0]):
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-5)
        assert len(lp.top) == n
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        want = torch.topk(ref[i], n)
        assert [t for t, _ in lp.top][: min(n, 10)] == want.indices.tolist()[: min(n, 10)]
        assert vals == pytest.approx(want.values.tolist(), abs=1e-5)
    assert out.logprobs[1].top[-1][1] == -math.inf  # only 10 finite tokens in row 1
    assert out.logprobs[3] is None
    assert out.token_ids[1] < 10


@pytest.mark.usefixtures("sampler_path")
def test_filtered_tokens_are_never_drawn_and_inf_rows_stay_finite():
    torch.manual_seed(7)
    logits = torch.randn(64, 40)
    logits[:, 30:] = float("-inf")
    seqs = [seq(SamplingParams(temperature=1.5, top_k=3, seed=(i if i % 2 else None)), rid=str(i)) for i in range(64)]
    out = Sampler(seed=0)(logits, seqs)
    top3 = logits.topk(3, dim=-1).indices
    assert all(t in top3[i].tolist() for i, t in enumerate(out.token_ids))
    one = Sampler(seed=0)(logits, [seq(SamplingParams(top_k=1), rid=str(i)) for i in range(64)])
    assert one.token_ids == logits.argmax(-1).tolist()


def test_bad_input_is_a_clear_value_error():
    s = Sampler()
    with pytest.raises(ValueError, match="logits must be"):
        s(torch.randn(2, 5), [seq(SamplingParams())])
    with pytest.raises(ValueError, match="floating-point"):
        s(torch.ones(1, 5, dtype=torch.long), [seq(SamplingParams())])
    dead = torch.randn(2, 5)
    dead[1] = float("-inf")
    with pytest.raises(ValueError, match=r"no finite maximum.*'dead'"):
        s(dead, [seq(SamplingParams(), rid="ok"), seq(SamplingParams(), rid="dead")])
    with pytest.raises(ValueError, match=r"negative token id.*'neg'"):
        s(torch.randn(1, 5), [seq(SamplingParams(repetition_penalty=1.2), prompt=[1, -3], rid="neg")])
    assert s(torch.randn(0, 5), []).token_ids == []


@pytest.mark.usefixtures("sampler_path")
def test_seeded_randomness_advances_with_each_output_token():
    logits = torch.zeros(1, 1000)  # uniform: only the per-step draw picks the token
    s = seq(SamplingParams(temperature=1.0, seed=7))
    sampler = Sampler()
    for _ in range(8):
        s.output_token_ids.append(sampler(logits, [s]).token_ids[0])
    assert len(set(s.output_token_ids)) > 1


needs_native = pytest.mark.skipif(not cpu_native.available(), reason="the C library did not build")


def _native(logits: torch.Tensor, params: list[SamplingParams], keys: list[int], filtered=None):
    return cpu_native.sample(logits, [p.temperature for p in params], [p.top_k for p in params],
                             [p.top_p for p in params], [p.min_p for p in params], keys, filtered)  # fmt: skip


@needs_native
@pytest.mark.parametrize("vocab", [V, 16384])
def test_native_warp_keeps_what_transformers_keeps(vocab):
    """The C path's filters (radix selection, no sort) keep exactly transformers' sets and scale
    by the same temperature, row by row in one batch."""
    torch.manual_seed(8)
    logits = torch.randn(len(WARP_CASES), vocab) * 3
    logits[0, :20] = float("-inf")
    filtered = torch.empty_like(logits)
    tokens = _native(logits, WARP_CASES, list(range(len(WARP_CASES))), filtered)
    for i, p in enumerate(WARP_CASES):
        ref = hf_warp(logits[i : i + 1].clone(), p)[0]
        assert torch.equal(filtered[i] > float("-inf"), ref > float("-inf")), f"kept set differs for {p}"
        kept = ref > float("-inf")
        torch.testing.assert_close(filtered[i][kept], ref[kept], rtol=0, atol=0)
        assert kept[tokens[i]], f"drew a removed token for {p}"


@needs_native
def test_native_draw_depends_only_on_its_key_and_skips_dead_rows():
    torch.manual_seed(9)
    logits = torch.randn(6, 300)
    p = [SamplingParams(temperature=1.0)] * 6
    a = _native(logits, p, [11, 12, 13, 14, 15, 16])
    b = _native(logits.flip(0), p, [16, 15, 14, 13, 12, 11]).flip(0)
    assert torch.equal(a, b)
    assert not torch.equal(a, _native(logits, p, [21, 22, 23, 24, 25, 26]))
    wide = torch.randn(6, 600)
    assert torch.equal(_native(wide[:, :300], p, list(range(6))), _native(wide[:, :300].contiguous(), p, list(range(6))))
    dead = torch.full((1, 10), float("-inf"))
    assert _native(dead, p[:1], [1]).tolist() == [-1]


@needs_native
@pytest.mark.parametrize("logits", [torch.zeros(64), torch.tensor([4.0, 0.1, -2.0] + [-9.0] * 5)])
def test_native_draws_follow_softmax_with_sequential_keys(logits):
    """Neighbouring keys (unseeded rows draw theirs, seeded ones hash theirs) still give independent
    draws with softmax's frequencies, flat and peaked."""
    n = 40_000
    tokens = _native(logits.expand(n, -1).contiguous(), [SamplingParams()] * n, list(range(n)))
    _check_frequencies(tokens.tolist(), logits.softmax(-1))


@needs_native
def test_native_top_p_keeps_every_tie_at_its_boundary():
    logits = torch.zeros(1, 10)
    logits[0, 0] = 1.0
    filtered = torch.empty_like(logits)
    _native(logits, [SamplingParams(top_p=0.2)], [5], filtered)
    assert (filtered > float("-inf")).sum() == 1  # the top token alone holds 23%
    # 40% needs two of the nine tied tokens: all nine are kept (torch keeps the two its sort put last)
    _native(logits, [SamplingParams(top_p=0.4)], [5], filtered)
    assert (filtered > float("-inf")).all()


@needs_native
def test_sampler_draws_on_cpu_through_the_native_path(monkeypatch):
    monkeypatch.setenv("LLMBUS_CPU_SAMPLER", "native")
    torch.manual_seed(10)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=77), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_k=20, seed=78)]  # fmt: skip
    seqs = [seq(p, output=[1] * i, rid=str(i)) for i, p in enumerate(params)]
    got = Sampler(seed=0)(logits, seqs).token_ids
    want = _native(logits[[0, 2]], [params[0], params[2]], [step_seed(77, 0), step_seed(78, 2)])
    assert got == [int(want[0]), int(logits[1].argmax()), int(want[1])]


@needs_native
def test_native_greedy_is_torch_argmax_and_flags_bad_rows():
    torch.manual_seed(12)
    x = torch.randn(9, 3 * 1000 + 7)[:, 5:3005]  # strided rows, an odd width
    x[1, [17, 900, 2999]] = 9.0  # ties: the first wins
    x[2] = torch.randint(-2, 3, x[2].shape).float()  # many ties
    x[3, :] = -0.0
    x[3, 41] = 0.0  # -0 and +0 are equal: the first of them
    x[4, :] = float("-inf")
    x[5, 77] = float("inf")
    x[6, 2000] = float("nan")  # a NaN anywhere spoils the row, as torch's amax says
    x[7, :] = float("-inf")
    x[7, 2999] = -1e30  # one finite entry, the last
    want = torch.where(torch.isfinite(x.amax(-1)), x.argmax(-1), -1)
    got = cpu_native.greedy(x)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    assert got.tolist()[4:7] == [-1, -1, -1] and got[7] == 2999 and got[1] == 17
    wide = torch.randn(64, 20000)  # large enough for the parallel loop
    assert torch.equal(cpu_native.greedy(wide), wide.argmax(-1))
    assert cpu_native.greedy(x.double()) is None and cpu_native.greedy(x.T) is None


@needs_native
def test_all_greedy_batches_take_the_native_argmax(monkeypatch):
    monkeypatch.setenv("LLMBUS_CPU_SAMPLER", "native")
    calls = []
    real = cpu_native.greedy
    monkeypatch.setattr(cpu_native, "greedy", lambda x: calls.append(x.shape) or real(x))
    torch.manual_seed(13)
    logits = torch.randn(5, V)
    greedy = [seq(SamplingParams(temperature=0.0, logprobs=2), rid=str(i)) for i in range(5)]
    out = Sampler()(logits, greedy)
    assert calls == [(5, V)] and out.token_ids == logits.argmax(-1).tolist()
    lp = logits.log_softmax(-1)
    assert [o.logprob for o in out.logprobs] == pytest.approx(lp.max(-1).values.tolist())
    logits[3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"no finite maximum.*'3'"):
        Sampler()(logits, greedy)
    # penalised or random rows keep the torch argmax (the check is on the raw logits)
    Sampler()(logits[:2], [seq(SamplingParams(temperature=0.0, presence_penalty=1.0), output=[1]), greedy[0]])
    Sampler(seed=1)(logits[:2], [seq(SamplingParams(temperature=0.7)), greedy[0]])
    assert len(calls) == 2


@needs_native
def test_native_uniforms_never_reach_one():
    """A uniform of exactly 1 would give its token log(-log 1) = -inf and the win: with 24 bits the
    largest of 2^24 values rounded up to 1 (a stray token in ~V / 2^24 draws)."""
    v, n = 128_256, 1024
    logits = torch.zeros(n, v)
    logits[:, 0] = 30.0  # every other token together: ~1e-8
    tokens = _native(logits, [SamplingParams()] * n, list(range(n)))
    assert (tokens == 0).all(), f"{int((tokens != 0).sum())} stray draws"


@needs_native
def test_native_top_k_edges():
    logits = torch.tensor([[1.0, 0.0, -0.0, -1.0]])
    filtered = torch.empty_like(logits)
    _native(logits, [SamplingParams(top_k=2)], [1], filtered)  # -0 ties +0 at the k-th value: both kept
    assert (filtered > float("-inf")).tolist() == [[True, True, True, False]]
    _native(logits, [SamplingParams(top_k=2**63)], [1], filtered)  # any integer: beyond V keeps all
    assert (filtered > float("-inf")).all()


@needs_native
@pytest.mark.parametrize("k", [33, 34, 35, 40, 49])
def test_native_top_k_past_the_finite_entries_keeps_them_all(k):
    """top_k above the number of finite logits (a guide masks the rest to -inf) keeps every finite
    one, as transformers' TopKLogitsWarper does: the radix selection walked into the smallest
    bucket with the leftover count and cut finite entries there (8 of 34 at k=35)."""
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 3
    logits[0, torch.randperm(50)[:16]] = float("-inf")  # 34 finite
    filtered = torch.empty_like(logits)
    _native(logits, [SamplingParams(top_k=k)], [1], filtered)
    ref = hf_warp(logits.clone(), SamplingParams(top_k=k))
    assert torch.equal(filtered > float("-inf"), ref > float("-inf"))


def test_huge_top_k_samples_on_every_path(sampler_path):
    out = Sampler(seed=0)(torch.randn(2, 50), [seq(SamplingParams(top_k=2**70), rid=str(i)) for i in range(2)])
    assert all(0 <= t < 50 for t in out.token_ids)


def test_overflowing_temperature_falls_back_to_the_best_raw_logit(sampler_path):
    logits = torch.full((1, 8), -1e36)
    logits[0, 3] = -1e35
    out = Sampler(seed=0)(logits, [seq(SamplingParams(temperature=1e-5 * 1.5))])
    assert out.token_ids == [3]


@pytest.mark.usefixtures("sampler_path")
def test_logit_bias_draws_as_from_biased_logits():
    """A row's logit_bias acts as if added to its logits: tokens equal the unbiased sampler's over
    logits + bias, row by row, greedy and seeded alike; logprobs still describe the raw logits."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g) * 3
    bias = ((5, 100.0), (9, -4.5), (int(logits[1].argmax()), -100.0))
    plain = [SamplingParams(temperature=0), SamplingParams(temperature=0),
             SamplingParams(temperature=0.8, seed=11, logprobs=2), SamplingParams(temperature=1.0, seed=12)]
    biased = [SamplingParams(temperature=0, logit_bias=bias[:1]), SamplingParams(temperature=0, logit_bias=bias[1:]),
              SamplingParams(temperature=0.8, seed=11, logprobs=2, logit_bias=bias), plain[3]]
    shifted = logits.clone()
    for row, p in enumerate(biased):
        for token, b in p.logit_bias:
            shifted[row, token] += b
    got = Sampler()(logits, [seq(p, rid=f"r{i}") for i, p in enumerate(biased)])
    want = Sampler()(shifted, [seq(p, rid=f"r{i}") for i, p in enumerate(plain)])
    assert got.token_ids == want.token_ids
    assert got.token_ids[0] == 5 and got.token_ids[1] != int(logits[1].argmax())
    raw = Sampler()(logits, [seq(p, rid=f"r{i}") for i, p in enumerate(plain)]).logprobs[2]
    assert got.logprobs[2].top == raw.top and got.logprobs[2].token_id == got.token_ids[2]


def test_logit_bias_is_checked():
    assert SamplingParams(logit_bias=[(3, 1), (4, -2.5)]).logit_bias == ((3, 1.0), (4, -2.5))
    for bad, match in (([(3, 101)], "in \\[-100, 100\\]"), ([(-1, 1.0)], "integers >= 0"), ([(2, 1), (2, 3)], "twice"),
                       ([(1.5, 1)], "integers"), ([(1,)], "pairs"), ([(1, float("nan"))], "in \\[-100")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="at most 1024 tokens"):
        SamplingParams(logit_bias=[(i, 1.0) for i in range(1025)])
