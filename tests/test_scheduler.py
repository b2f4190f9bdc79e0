"""Scheduler: token budget, chunked prefill, admission, stop conditions, preemption, abort, leaks.

Steps are driven by ``PagedEcho``, test input standing in for the runner: a paged "KV cache" that
stores each position's token id at its slot, and a next-token rule computed from the context read
back through the block table. A wrong block table, a wrongly shared block or a bad recompute
changes the tokens, which are checked against ``reference_output`` (plain Python, no scheduler).
"""

from __future__ import annotations

import pytest

from llmbus.engine.block_manager import BlockManager
from llmbus.engine.sampling_params import SamplingParams
from llmbus.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from llmbus.engine.sequence import Sequence, SequenceStatus, TokenLogprob

BS = 4


def next_token(context: list[int]) -> int:
    return sum((k + 1) * t for k, t in enumerate(context)) % 997 + 3


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(next_token(ids))
    return ids[len(prompt) :]


class PagedEcho:
    def __init__(self, bm: BlockManager, script: dict[str, list[int]] | None = None) -> None:
        self.bm = bm
        self.script = script or {}
        self.cache: dict[int, tuple[int, int]] = {}  # slot -> (position, token id)

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // BS] * BS + pos % BS

    def __call__(self, out: SchedulerOutput) -> dict[str, tuple[int, TokenLogprob | None]]:
        sampled = {}
        for e in out.scheduled:
            seq, start = e.seq, e.seq.num_computed_tokens
            end = start + e.num_new_tokens
            ids = seq.all_token_ids
            assert end <= seq.num_tokens and len(seq.block_table) * BS >= end
            for pos in range(start, end):
                # A computed block is immutable: nobody writes into a block someone else holds.
                assert self.bm.ref_count(seq.block_table[pos // BS]) == 1
                self.cache[self.slot(seq, pos)] = (pos, ids[pos])
            assert e.sample == (end == seq.num_tokens)
            if e.sample:
                context = [self.cache[self.slot(seq, p)] for p in range(end)]
                assert context == list(enumerate(ids))
                script = self.script.get(seq.request_id)
                tok = script[len(seq.output_token_ids)] if script else next_token(ids)
                lp = TokenLogprob(tok, -0.5, [(tok, -0.5)]) if seq.params.logprobs is not None else None
                sampled[seq.request_id] = [(tok, lp)]
        return sampled


def make(num_blocks=64, **cfg) -> tuple[Scheduler, BlockManager, PagedEcho]:
    bm = BlockManager(num_blocks, BS)
    return Scheduler(SchedulerConfig(**cfg), bm), bm, PagedEcho(bm)


def seq(rid: str, prompt: list[int], salt: str = "", eos=(), **params) -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(**params), eos_token_ids=tuple(eos), cache_salt=salt)


def step(sched: Scheduler, model: PagedEcho):
    out = sched.schedule()
    ones = [e.num_new_tokens == 1 for e in out.scheduled]
    assert ones == sorted(ones, reverse=True)  # single-token entries first
    assert out.num_batched_tokens == sum(e.num_new_tokens for e in out.scheduled)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    finished = sched.update(out, model(out))
    return out, finished


def plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(e.seq.request_id, e.num_new_tokens, e.sample) for e in out.scheduled]


def run_to_end(sched, model, max_steps=500):
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished
        finished += step(sched, model)[1]
    raise AssertionError("the scheduler did not drain")


def assert_no_leaks(bm: BlockManager) -> None:
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == [0] * bm.num_blocks
    assert bm.num_free_blocks == bm.num_blocks


def test_budget_goes_to_decodes_then_chunks_then_admissions():
    sched, bm, model = make(max_num_batched_tokens=10)
    a, b, c = seq("a", [1, 2, 3]), seq("b", range(100, 120)), seq("c", range(200, 206))
    sched.add(a)
    sched.add(b)
    assert plan(step(sched, model)[0]) == [("a", 3, True), ("b", 7, False)]
    sched.add(c)
    assert plan(step(sched, model)[0]) == [("a", 1, True), ("b", 9, False)]
    assert sched.num_waiting == 1  # the budget is spent
    assert plan(step(sched, model)[0]) == [("a", 1, True), ("b", 4, True), ("c", 5, False)]
    assert plan(step(sched, model)[0]) == [("a", 1, True), ("b", 1, True), ("c", 1, True)]
    assert plan(step(sched, model)[0]) == [("a", 1, True), ("b", 1, True), ("c", 1, True)]
    assert sched.num_running == 3 and sched.num_waiting == 0
    assert a.output_token_ids == reference_output([1, 2, 3], 5)
    assert b.output_token_ids == reference_output(list(range(100, 120)), 3)


def test_long_prompt_is_prefilled_in_chunks_over_several_steps():
    sched, bm, model = make(max_num_batched_tokens=100, long_prefill_token_threshold=5)
    s = seq("s", range(10, 22), max_tokens=3)
    sched.add(s)
    plans = [plan(step(sched, model)[0]) for _ in range(3)]
    assert plans == [[("s", 5, False)], [("s", 5, False)], [("s", 2, True)]]
    assert s.num_computed_tokens == 12 and len(s.output_token_ids) == 1
    out, finished = step(sched, model)
    assert plan(out) == [("s", 1, True)]
    assert run_to_end(sched, model) == [s]
    assert s.output_token_ids == reference_output(list(range(10, 22)), 3)
    assert_no_leaks(bm)


def test_without_chunking_a_prompt_is_scheduled_whole():
    sched, bm, model = make(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    a, b = seq("a", range(10), max_tokens=2), seq("b", range(50, 60), max_tokens=2)
    sched.add(a)
    sched.add(b)
    assert plan(step(sched, model)[0]) == [("a", 10, True)]
    assert sched.num_waiting == 1  # 6 tokens of budget left: b is not split
    assert plan(step(sched, model)[0]) == [("a", 1, True), ("b", 10, True)]
    run_to_end(sched, model)
    assert b.output_token_ids == reference_output(list(range(50, 60)), 2)
    assert_no_leaks(bm)


def test_max_num_seqs_caps_the_running_batch():
    sched, bm, model = make(max_num_seqs=2)
    a, b, c = (seq(r, [i, i + 1, i + 2], max_tokens=m) for r, i, m in (("a", 1, 2), ("b", 5, 4), ("c", 9, 2)))
    for s in (a, b, c):
        sched.add(s)
    assert plan(step(sched, model)[0]) == [("a", 3, True), ("b", 3, True)]
    out, finished = step(sched, model)
    assert plan(out) == [("a", 1, True), ("b", 1, True)] and finished == [a]
    assert plan(step(sched, model)[0]) == [("b", 1, True), ("c", 3, True)]
    run_to_end(sched, model)
    assert_no_leaks(bm)


def test_copies_of_one_prompt_are_prefilled_once():
    sched, bm, model = make()
    prompt = list(range(30, 40))  # blocks 0 and 1 are full before the last token
    copies = [seq(r, prompt, max_tokens=3) for r in "abcd"]
    for s in copies:
        sched.add(s)
    # the copies wait while "a" computes the blocks they share, then take them from the cache
    assert plan(step(sched, model)[0]) == [("a", 10, True)]
    assert plan(step(sched, model)[0]) == [("a", 1, True), ("b", 2, True), ("c", 2, True), ("d", 2, True)]
    assert [s.num_cached_tokens for s in copies] == [0, 8, 8, 8]
    run_to_end(sched, model)
    for s in copies:
        assert s.output_token_ids == reference_output(prompt, 3)
    assert_no_leaks(bm)


def test_a_copy_waits_for_every_chunk_of_a_long_shared_prefix():
    sched, bm, model = make(max_num_batched_tokens=100, long_prefill_token_threshold=5)
    system = list(range(100, 112))
    a, b = seq("a", system + [1, 2], max_tokens=2), seq("b", system + [7], max_tokens=2)
    other = seq("c", [9, 8, 7], max_tokens=2)
    for s in (a, b, other):
        sched.add(s)
    # b's first uncached block is one a is computing, so b waits; c, sharing nothing, does not
    assert plan(step(sched, model)[0]) == [("a", 5, False), ("c", 3, True)]
    assert plan(step(sched, model)[0]) == [("c", 1, True), ("a", 5, False)]
    assert sched.num_waiting == 1  # a has committed blocks 0 and 1; block 2 is still to come
    assert plan(step(sched, model)[0]) == [("a", 4, True)]
    out = step(sched, model)[0]
    assert plan(out) == [("a", 1, True), ("b", 1, True)] and b.num_cached_tokens == 12
    run_to_end(sched, model)
    assert a.output_token_ids == reference_output(system + [1, 2], 2)
    assert b.output_token_ids == reference_output(system + [7], 2)
    assert_no_leaks(bm)


@pytest.mark.parametrize("end", ["abort", "preempt"])
def test_a_waiting_copy_runs_when_the_prefill_it_waits_for_goes_away(end):
    sched, bm, model = make(max_num_batched_tokens=100, long_prefill_token_threshold=4)
    prompt = list(range(60, 73))
    a, b = seq("a", prompt, max_tokens=2), seq("b", prompt, max_tokens=2)
    sched.add(a)
    sched.add(b)
    assert plan(step(sched, model)[0]) == [("a", 4, False)]
    if end == "abort":
        sched.abort("a")
        # b takes the block a committed and computes the rest itself
        assert plan(step(sched, model)[0]) == [("b", 4, False)] and b.num_cached_tokens == 4
    else:
        sched._preempt(a)  # what running out of blocks does: a is waiting again, holding nothing
        assert plan(step(sched, model)[0]) == [("a", 4, False)] and a.num_cached_tokens == 0
        # a took its own committed block back; b waits on a again
    run_to_end(sched, model)
    for s in ((b,) if end == "abort" else (a, b)):
        assert s.output_token_ids == reference_output(prompt, 2)
    assert_no_leaks(bm)


def test_a_prompt_nearly_all_cached_rides_along_ahead_of_a_long_one():
    """A waiting prompt with a few tokens left to compute (the prefix cache holds the rest) takes
    them out of turn, up to a 16th of the budget, inside it: its first token comes in this step,
    not after the long prompt ahead of it is computed whole. Its tokens are still exact."""
    sched, bm, model = make(max_num_batched_tokens=64)  # 4 tokens may ride along
    shared = list(range(300, 316))
    sched.add(seq("warm", shared, max_tokens=1))
    run_to_end(sched, model)  # its 3 full blocks before the last token stay cached
    long, cached = seq("long", range(500, 600), max_tokens=2), seq("cached", shared, max_tokens=3)
    too_many = seq("too-many", shared[:12] + [7, 8, 9, 10, 11, 12], max_tokens=2)  # 6 tokens left: waits
    for s in (long, too_many, cached):
        sched.add(s)
    out, _ = step(sched, model)
    assert plan(out) == [("long", 60, False), ("cached", 4, True)]
    assert cached.num_cached_tokens == 12 and too_many.status is SequenceStatus.WAITING
    run_to_end(sched, model)
    assert cached.output_token_ids == reference_output(shared, 3)
    assert long.output_token_ids == reference_output(list(range(500, 600)), 2)
    assert too_many.output_token_ids == reference_output(too_many.prompt_token_ids, 2)
    assert_no_leaks(bm)


def test_a_rider_keeps_the_chunk_cap():
    """--long-prefill-threshold caps every prompt's chunk: one that would ride along in a larger
    chunk waits its turn."""
    sched, bm, model = make(max_num_batched_tokens=64, long_prefill_token_threshold=2)
    small = seq("small", [5, 6, 7], max_tokens=1)  # 3 tokens: more than one capped chunk
    sched.add(seq("long", range(500, 600), max_tokens=1))
    sched.add(small)
    assert plan(step(sched, model)[0]) == [("long", 2, False), ("small", 2, False)]  # FCFS, capped
    run_to_end(sched, model)
    assert small.output_token_ids == reference_output([5, 6, 7], 1)
    assert_no_leaks(bm)


def test_a_waiting_copy_keeps_its_batch_slot():
    """A copy waiting for a prefill holds its place against max_num_seqs: a later, unrelated
    request does not take the last slot and leave the copy waiting for a whole sequence to end."""
    sched, bm, model = make(max_num_seqs=2, max_num_batched_tokens=100, long_prefill_token_threshold=4)
    prompt = list(range(60, 73))
    a, b, c = seq("a", prompt, max_tokens=30), seq("b", prompt, max_tokens=30), seq("c", [1, 2, 3], max_tokens=30)
    for s in (a, b, c):
        sched.add(s)
    assert plan(step(sched, model)[0]) == [("a", 4, False)]  # b waits for a; c does not overtake it
    while b.status is SequenceStatus.WAITING:
        assert c.status is SequenceStatus.WAITING
        step(sched, model)
    assert b.num_cached_tokens == 12 and a.num_computed_tokens == 13
    run_to_end(sched, model)
    for s in (a, b):
        assert s.output_token_ids == reference_output(prompt, 30)
    assert_no_leaks(bm)


def test_without_prefix_caching_copies_are_computed_side_by_side():
    bm = BlockManager(64, BS, enable_prefix_caching=False)
    sched, model = Scheduler(SchedulerConfig(), bm), PagedEcho(bm)
    prompt = list(range(30, 40))
    for r in "ab":
        sched.add(seq(r, prompt, max_tokens=2))
    assert plan(step(sched, model)[0]) == [("a", 10, True), ("b", 10, True)]
    run_to_end(sched, model)
    assert_no_leaks(bm)


SCRIPT = [5, 7, 9, 11, 13, 15, 17]


@pytest.mark.parametrize(
    "params, eos, max_model_len, expected, reason",
    [
        (dict(max_tokens=6), (9,), 64, [5, 7, 9], "stop"),
        (dict(max_tokens=5, ignore_eos=True), (9,), 64, [5, 7, 9, 11, 13], "length"),
        (dict(max_tokens=6, stop_token_ids=(7,)), (), 64, [5, 7], "stop"),
        (dict(max_tokens=6, stop_token_ids=(11,), ignore_eos=True), (9,), 64, [5, 7, 9, 11], "stop"),
        (dict(max_tokens=3, logprobs=1), (), 64, [5, 7, 9], "length"),
        (dict(max_tokens=6), (), 8, [5, 7, 9, 11], "length"),  # 4-token prompt, 8-token context
    ],
)
def test_stop_conditions(params, eos, max_model_len, expected, reason):
    sched, bm, _ = make(max_model_len=max_model_len)
    model = PagedEcho(bm, script={"s": SCRIPT})
    s = seq("s", [1, 2, 3, 4], eos=eos, **params)
    sched.add(s)
    finished = run_to_end(sched, model)
    assert finished == [s]
    assert s.output_token_ids == expected
    assert s.finish_reason == reason and s.status is SequenceStatus.FINISHED
    assert len(s.output_logprobs) == (len(expected) if params.get("logprobs") is not None else 0)
    assert_no_leaks(bm)
    # The finished seq's full computed blocks stay cached (its last token was never computed).
    assert bm.num_cached_blocks == (4 + len(expected) - 1) // BS


def test_preemption_by_recompute_when_the_pool_runs_out():
    sched, bm, model = make(num_blocks=4)
    pa, pb = [1, 2, 3, 4], [11, 12, 13, 14]
    a, b = seq("a", pa, max_tokens=8), seq("b", pb, max_tokens=8)
    sched.add(a)
    sched.add(b)
    log = []
    while sched.has_unfinished():
        out, finished = step(sched, model)
        log.append((plan(out), [s.request_id for s in out.preempted], [s.request_id for s in finished]))
    decode_both = ([("a", 1, True), ("b", 1, True)], [], [])
    assert log == [
        ([("a", 4, True), ("b", 4, True)], [], []),
        decode_both, decode_both, decode_both, decode_both,
        ([("a", 1, True)], ["b"], []),  # a needs a fifth block: b, the newest, is preempted
        ([("a", 1, True)], [], []),  # b's recompute needs 2 blocks besides its cached one
        ([("a", 1, True)], [], ["a"]),
        ([("b", 5, True)], [], []),  # b re-admitted: 4 tokens from the cache, 5 recomputed
        ([("b", 1, True)], [], []),
        ([("b", 1, True)], [], ["b"]),
    ]
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert b.num_cached_tokens == 0  # usage counts the first admission only
    assert a.output_token_ids == reference_output(pa, 8)
    assert b.output_token_ids == reference_output(pb, 8)
    assert_no_leaks(bm)


def test_waiting_sequences_are_admitted_by_priority_then_age():
    sched, bm, model = make(max_num_seqs=1)
    order = []
    for rid, priority in (("n1", 0), ("n2", 0), ("late", 5), ("u1", -1), ("n3", 0), ("u2", -1)):
        s = seq(rid, [len(order) + 1, 2, 3], max_tokens=1)
        s.priority = priority
        order.append(s)
        sched.add(s)
    admitted = []
    while sched.has_unfinished():
        admitted += [e.seq.request_id for e in step(sched, model)[0].scheduled if e.num_new_tokens > 1]
    assert admitted == ["u1", "u2", "n1", "n2", "n3", "late"]
    assert_no_leaks(bm)


def test_preemption_takes_the_largest_priority_first_and_it_resumes_ahead_of_its_own():
    sched, bm, model = make(num_blocks=4)
    a, b = seq("a", [1, 2, 3, 4], max_tokens=8), seq("b", [11, 12, 13, 14], max_tokens=8)
    a.priority = 1  # older, but less urgent: it yields its blocks to b
    sched.add(a)
    sched.add(b)
    preempted = []
    while sched.has_unfinished() and not preempted:
        preempted = [s.request_id for s in step(sched, model)[0].preempted]
    assert preempted == ["a"] and b.num_preemptions == 0
    c = seq("c", [21, 22, 23], max_tokens=1)
    c.priority = 1
    sched.add(c)  # newer, same priority as a: a resumes before it
    d = seq("d", [31, 32, 33], max_tokens=1)
    sched.add(d)  # more urgent than both: ahead of a
    assert [s.request_id for s in sched._waiting] == ["d", "a", "c"]
    run_to_end(sched, model)
    assert a.output_token_ids == reference_output([1, 2, 3, 4], 8)
    assert b.output_token_ids == reference_output([11, 12, 13, 14], 8)
    assert_no_leaks(bm)


def test_a_sequence_outgrowing_the_whole_pool_ends_with_length():
    sched, bm, model = make(num_blocks=2)
    s = seq("s", range(6), max_tokens=10)
    sched.add(s)
    plans = [step(sched, model) for _ in range(4)]
    assert [plan(o) for o, _ in plans] == [[("s", 6, True)], [("s", 1, True)], [("s", 1, True)], []]
    assert plans[3][0].preempted == [s] and s.status is SequenceStatus.WAITING
    out, finished = step(sched, model)
    assert out.rejected == [s] and finished == [s] and out.scheduled == []
    assert s.finish_reason == "length" and s.output_token_ids == reference_output(list(range(6)), 3)
    assert not sched.has_unfinished()
    assert_no_leaks(bm)


def test_prompts_that_can_never_fit_do_not_wedge_the_queue():
    sched, bm, model = make(num_blocks=3, max_model_len=10)
    too_many_blocks = seq("x", range(13))  # 4 blocks > pool of 3
    too_long = seq("y", range(11))  # longer than max_model_len
    ok = seq("z", range(5), max_tokens=2)
    for s in (too_many_blocks, too_long, ok):
        sched.add(s)
    out, finished = step(sched, model)
    assert out.rejected == [too_many_blocks, too_long]
    assert plan(out) == [("z", 5, True)]
    assert finished == [too_many_blocks, too_long]
    assert {s.finish_reason for s in finished} == {"length"}
    assert too_long.output_token_ids == [] and too_long.status is SequenceStatus.FINISHED
    run_to_end(sched, model)
    assert ok.output_token_ids == reference_output(list(range(5)), 2)
    assert_no_leaks(bm)


def test_abort_in_every_state():
    sched, bm, model = make(num_blocks=8, max_num_seqs=1)
    run, wait, done = seq("run", range(6)), seq("wait", range(20, 26)), seq("done", [1, 2], max_tokens=1)
    sched.add(done)
    run_to_end(sched, model)
    assert sched.abort("done") is None  # already finished
    assert sched.abort("nobody") is None
    sched.add(run)
    sched.add(wait)
    step(sched, model)
    assert run.status is SequenceStatus.RUNNING and bm.num_free_blocks == 8 - 2
    assert sched.abort("wait") is wait
    assert wait.finish_reason == "abort" and wait.status is SequenceStatus.FINISHED
    assert sched.num_waiting == 0
    assert sched.abort("run") is run
    assert run.finish_reason == "abort" and run.block_table == []
    assert_no_leaks(bm)
    assert not sched.has_unfinished()
    assert sched.abort("run") is None


def test_abort_between_schedule_and_update():
    sched, bm, model = make()
    s = seq("s", range(9))
    sched.add(s)
    out = sched.schedule()
    sampled = model(out)
    assert sched.abort("s") is s
    assert sched.update(out, sampled) == []
    assert s.output_token_ids == [] and s.finish_reason == "abort"
    assert_no_leaks(bm)


def test_handed_off_sequence_joins_with_a_decode():
    sched, bm, model = make(num_blocks=8)
    prompt = list(range(30, 39))
    h = seq("h", prompt, max_tokens=3)
    h.output_token_ids.append(next_token(prompt))
    assert bm.allocate_computed(h, len(prompt))
    for pos in range(len(prompt)):  # the KV "arrives" from the prefill worker
        model.cache[model.slot(h, pos)] = (pos, prompt[pos])
    sched.add(h)
    assert plan(step(sched, model)[0]) == [("h", 1, True)]
    run_to_end(sched, model)
    assert h.output_token_ids == reference_output(prompt, 3)
    assert_no_leaks(bm)


def test_a_handoff_queued_behind_a_preempted_sequence_cannot_wedge_the_queue():
    """b outgrows what a leaves and preempts itself to the head of the queue, blockless; a handoff h
    then arrives holding its KV and waits behind b. Once a finishes, what is free is less than b
    needs and nothing runs: h gives its blocks back (it recomputes later, as a preempted sequence
    does) instead of everyone waiting forever."""
    sched, bm, model = make(num_blocks=6)
    pa, pb, ph = list(range(1, 3)), list(range(100, 108)), list(range(300, 312))
    a, b = seq("a", pa, max_tokens=8), seq("b", pb, max_tokens=8)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched, model)
    while b.status is not SequenceStatus.WAITING:
        out, _ = step(sched, model)
    assert out.preempted == [b] and b.block_table == []
    h = seq("h", ph, max_tokens=2)
    h.output_token_ids.append(next_token(ph))
    assert bm.allocate_computed(h, len(ph))  # 3 of the 6 blocks, while b waits for 4
    for pos in range(len(ph)):
        model.cache[model.slot(h, pos)] = (pos, ph[pos])
    sched.add(h)
    run_to_end(sched, model)
    assert all(s.status is SequenceStatus.FINISHED for s in (a, b, h)) and h.num_preemptions == 1
    assert a.output_token_ids == reference_output(pa, 8) and b.output_token_ids == reference_output(pb, 8)
    assert h.output_token_ids == reference_output(ph, 2)
    assert_no_leaks(bm)


def test_mixed_workload_with_sharing_preemption_and_aborts_leaks_nothing():
    sched, bm, model = make(
        num_blocks=9, max_num_batched_tokens=16, max_num_seqs=4, long_prefill_token_threshold=6
    )
    system = list(range(500, 508))
    seqs = []
    for i in range(8):
        prompt = system + [i, i + 1, i + 2][: 1 + i % 3]
        seqs.append(seq(f"r{i}", prompt, salt=f"t{i % 2}", max_tokens=4 + i % 5))
    for s in seqs:
        sched.add(s)
    aborted = set()
    n = 0
    while sched.has_unfinished():
        n += 1
        assert n < 500
        if n == 2:
            assert seqs[6].status is SequenceStatus.WAITING
            aborted.add(sched.abort("r6").request_id)
        if "r3" not in aborted and seqs[3].num_preemptions == 1 and seqs[3].status is SequenceStatus.RUNNING:
            aborted.add(sched.abort("r3").request_id)  # preempted, then admitted again
        step(sched, model)
    assert aborted == {"r3", "r6"}
    assert sum(s.num_preemptions for s in seqs) > 0
    assert sum(s.num_cached_tokens for s in seqs) > 0
    for s in seqs:
        assert s.status is SequenceStatus.FINISHED
        if s.request_id not in aborted:
            assert s.output_token_ids == reference_output(s.prompt_token_ids, s.params.max_tokens)
            assert s.finish_reason == "length"
    assert_no_leaks(bm)
    assert bm.num_cached_blocks > 0


def test_bad_config_and_requests_give_clear_errors():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=8, max_model_len=16)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    sched, bm, model = make()
    sched.add(seq("a", [1]))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(seq("a", [2]))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(seq("b", []))
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(out, {})
