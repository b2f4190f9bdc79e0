"""A request resumed where another worker stopped: the engine takes the output tokens its client
already has as context and samples on from them (greedy and seeded requests exactly as if
nothing had happened), and a worker that stops before its requests end hands them on as resume
jobs instead of failing them or letting another worker start them again from the first token."""

from __future__ import annotations

import pytest

from llmbus.engine.llm import LLM
from llmbus.engine.sampling_params import SamplingParams
from llmbus.protocol import GenerateRequest, SamplingSpec
from tests.test_engine import model_dir, prompts  # noqa: F401 - fixtures

N = 12


def _tokens(engine, rid: str, prompt: list[int], params: SamplingParams, done: list[int] = ()) -> list[int]:
    engine.add_request(rid, prompt, params, output_token_ids=list(done))
    out = list(done)
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    return out


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=N, temperature=1.0, seed=7, ignore_eos=True)],
                         ids=["greedy", "seeded"])  # fmt: skip
def test_a_resumed_request_continues_as_if_uninterrupted(model_dir, prompts, params):  # noqa: F811
    engine = LLM(model_dir, dtype="float32", device="cpu").engine
    whole = _tokens(engine, "whole", prompts[3], params)
    for cut in (1, 5, N - 1):
        assert _tokens(engine, f"resumed-{cut}", prompts[3], params, whole[:cut]) == whole
    assert engine.leak_check()["free_blocks"] == engine.leak_check()["total_blocks"]


def test_resumed_tokens_are_checked(model_dir, prompts):  # noqa: F811
    engine = LLM(model_dir, dtype="float32", device="cpu").engine
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="leave none of max_tokens 4"):
        engine.add_request("done-already", prompts[0], params, output_token_ids=[5, 6, 7, 8])
    with pytest.raises(ValueError, match="output token"):
        engine.add_request("bad-token", prompts[0], params, output_token_ids=[10**6])
    with pytest.raises(ValueError, match="context"):
        engine.add_request("too-long", prompts[0], SamplingParams(max_tokens=10**4),
                           output_token_ids=[5] * engine.max_model_len)  # fmt: skip
    assert not engine.has_unfinished()


@pytest.mark.parametrize("fields, message", [
    (dict(resume_token_ids=[5, 6], resume_seq=0), "resume_seq"),
    (dict(resume_token_ids=[5, 6], resume_seq=2, sampling=SamplingSpec(max_tokens=2)), "left none to generate"),
    (dict(resume_token_ids=[-1], resume_seq=1), "resume_token_ids must be token ids"),
    (dict(resume_seq=-1), "resume_seq must be in"),
])  # fmt: skip
def test_a_resume_that_does_not_add_up_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        GenerateRequest("r", "m", [1, 2], **fields)


# --- through workers on a real bus -----------------------------------------------------------

def _sent(evs) -> list:
    """The events workers sent with their tokens: without the hand-on notice, the stopped worker's
    repeat of its last seq from no worker (so the gateway does not wait on it), one per hand-on."""
    notices = [e for e in evs if not e.worker]
    assert len(notices) == 1 and not notices[0].token_ids
    return [e for e in evs if e.worker]


def _contiguous_handover(evs, first_worker: str, total: int) -> int:
    """Where the second worker took over: the client's events are seq 0..total-1 without a gap or
    a repeat (none restarted from the first token), the first worker's then the second's."""
    evs = _sent(evs)
    assert [e.seq for e in evs] == list(range(len(evs)))
    assert sum(len(e.token_ids) for e in evs) == total and evs[-1].finish_reason == "length"
    cut = next(i for i, e in enumerate(evs) if e.worker != first_worker)
    assert 0 < cut and all(e.worker != first_worker for e in evs[cut:])
    return cut


def test_a_colocated_worker_that_stops_hands_its_request_on(nats_server, tmp_path):
    """Stopped with no drain time left, a colocated worker queues the request it is generating as
    a resume job; the next worker continues from the tokens the client has, at the next seq."""
    import asyncio

    from llmbus.engine.engine import Engine
    from llmbus.engine.config import EngineConfig
    from llmbus.model.demo import make_demo_model
    from services.prefill.service import PrefillWorker
    from tests.test_decode_worker import serving, slow_steps
    from tests.test_prefill_worker import _bus, _submit, _token_events

    model, rid, total = "handon-colocated", "handon-colocated-0", 24
    model_dir = make_demo_model(tmp_path / "m", "small")
    make = lambda: Engine.from_model_dir(str(model_dir), EngineConfig(dtype="float32", device="cpu"))  # noqa: E731
    prompt = list(range(5, 45))
    expected = _tokens(make(), "ref", prompt, SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True))
    first = make()
    slow_steps(first, 0.05)

    async def body():
        nc, js = await _bus(nats_server)
        events, done = await _token_events(nc, lambda ev: ev.request_id == rid and ev.finish_reason is not None)
        async with serving(nats_server, "prefill", model,
                           lambda ctx: PrefillWorker(ctx, first, model, colocated=True, drain_s=0)) as a:  # fmt: skip
            await _submit(js, model, rid, prompt, total)
            while len(events.get(rid, ())) < 4:
                await asyncio.sleep(0.01)
            a_id = a.ctx.instance_id
        (handed_on,) = [f for f in a.metric_families() if f.name == "llmbus_worker_requests_handed_on_total"]
        assert [(s.labels, s.value) for s in handed_on.samples] == [([model], 1.0)]
        async with serving(nats_server, "prefill", model, lambda ctx: PrefillWorker(ctx, make(), model, colocated=True)):
            await asyncio.wait_for(done.wait(), 60)
        await nc.close()
        return events[rid], a_id

    evs, a_id = asyncio.run(body())
    cut = _contiguous_handover(evs, a_id, total)
    evs = _sent(evs)
    assert [t for e in evs for t in e.token_ids] == expected  # greedy: as if nothing had happened
    assert evs[-1].completion_tokens == total and evs[-1].prompt_tokens == len(prompt)
    assert evs[cut].completion_tokens == cut + 1  # the new worker counts the tokens it resumed from


def test_a_decode_worker_that_stops_hands_its_whole_request_on(nats_server, tmp_path):
    import asyncio

    from llmbus.bus import subjects
    from llmbus.bus.connection import connect
    from llmbus.bus.streams import ensure_streams
    from llmbus.model.demo import make_demo_model
    from llmbus.protocol import encode
    from services.decode.service import DecodeWorker
    from tests.test_decode_worker import _engine, serving, slow_steps
    from tests.test_prefill_worker import _token_events

    model, rid, total = "handon-decode", "handon-decode-0", 24
    model_dir = make_demo_model(tmp_path / "m", "small")
    prompt = list(range(5, 25))
    params = SamplingParams(max_tokens=total, temperature=0.9, seed=11, ignore_eos=True)  # seeded: exact too
    expected = _tokens(_engine(model_dir), "ref", prompt, params)
    first = _engine(model_dir)
    slow_steps(first, 0.05)
    req = GenerateRequest(rid, model, prompt, token_subject=subjects.tokens(rid), lane="short",
                          sampling=SamplingSpec(max_tokens=total, temperature=0.9, seed=11, ignore_eos=True))

    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        await ensure_streams(js)
        events, done = await _token_events(nc, lambda ev: ev.request_id == rid and ev.finish_reason is not None)
        async with serving(nats_server, "decode", model, lambda ctx: DecodeWorker(ctx, first, model, drain_s=0)) as a:
            await js.publish(subjects.whole_subject("short", model), encode(req), headers={subjects.MSG_ID_HEADER: rid})
            while len(events.get(rid, ())) < 4:
                await asyncio.sleep(0.01)
            a_id = a.ctx.instance_id
        async with serving(nats_server, "decode", model, lambda ctx: DecodeWorker(ctx, _engine(model_dir), model)):
            await asyncio.wait_for(done.wait(), 60)
        await nc.close()
        return events[rid], a_id

    evs, a_id = asyncio.run(body())
    _contiguous_handover(evs, a_id, total)
    assert [t for e in _sent(evs) for t in e.token_ids] == expected


def test_a_handed_off_request_is_handed_on_through_prefill_again(nats_server, tmp_path):
    """Disaggregated: the decode worker that stops queues its request in the prefill lane; a
    prefill worker computes prompt and tokens so far, sends the next token at the next seq and
    hands off again (its own handoff, not taken for the first one's repeat), and another decode
    worker finishes it."""
    import asyncio

    from services.decode.service import DecodeWorker
    from services.prefill.service import PrefillWorker
    from tests.test_decode_worker import _engine, serving, slow_steps, with_kvpool
    from tests.test_prefill_worker import _handing_off_bus, _submit, _token_events
    from llmbus.model.demo import make_demo_model

    model, rid, total = "handon-split", "handon-split-0", 24
    model_dir = make_demo_model(tmp_path / "m", "small")
    prompt = list(range(5, 45))
    expected = _tokens(_engine(model_dir), "ref", prompt, SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True))
    first = _engine(model_dir)
    slow_steps(first, 0.05)

    async def body():
        nc, js, _ = await _handing_off_bus(nats_server, model)
        events, done = await _token_events(nc, lambda ev: ev.request_id == rid and ev.finish_reason is not None)
        async with serving(nats_server, "prefill", model, lambda ctx: PrefillWorker(ctx, _engine(model_dir), model)) as p:
            async with serving(nats_server, "decode", model, lambda ctx: DecodeWorker(ctx, first, model, drain_s=0)) as a:
                await _submit(js, model, rid, prompt, total)
                while len(events.get(rid, ())) < 4:
                    await asyncio.sleep(0.01)
                a_id = a.ctx.instance_id
            async with serving(nats_server, "decode", model, lambda ctx: DecodeWorker(ctx, _engine(model_dir), model)) as c:
                await asyncio.wait_for(done.wait(), 60)
                workers = (p.ctx.instance_id, a_id, c.ctx.instance_id)
        await nc.close()
        return events[rid], workers

    evs, (p_id, a_id, c_id) = with_kvpool(nats_server, first, body)
    evs = _sent(evs)
    assert [e.seq for e in evs] == list(range(len(evs))) and evs[-1].finish_reason == "length"
    assert [t for e in evs for t in e.token_ids] == expected
    by = [e.worker for e in evs]
    cut = by.index(p_id, 1)  # prefill's second first token
    assert by[0] == p_id and set(by[1:cut]) == {a_id} and set(by[cut + 1:]) == {c_id}, by


def test_a_handoff_waiting_for_kvpool_room_at_shutdown_is_handed_on(nats_server, tmp_path):
    """Handing off, a prefill worker whose handoff waits for room in a full kvpool when it stops
    has sent its first token: the request goes back to its lane as a resume job from that token
    (taken again from the start, another worker's first token would follow this one's)."""
    import asyncio

    from llmbus.bus import subjects
    from llmbus.bus.streams import ensure_prefill_consumer
    from llmbus.bus.worker import PullWorker
    from llmbus.protocol import decode
    from services.prefill.service import PrefillWorker
    from tests.test_decode_worker import serving, with_kvpool
    from tests.test_prefill_worker import _engine, _handing_off_bus, _submit, _token_events

    model, rid = "handon-waiting", "handon-waiting-0"
    engine = _engine(tmp_path, enable_prefix_caching=False)

    async def body():
        nc, js, client = await _handing_off_bus(nats_server, model)
        stats = await client.stats()
        filler = await client.allocate(stats.free_blocks, ttl_s=60, request_id="filler")  # kvpool full
        events, _ = await _token_events(nc, lambda ev: False)
        async with serving(nats_server, "prefill", model, lambda ctx: PrefillWorker(ctx, engine, model, drain_s=0)) as p:
            await _submit(js, model, rid, list(range(5, 45)), 16)
            while rid not in events:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # (its handoff asks kvpool for room, and waits)
            assert rid in p.jobs
        lane = await PullWorker.bind(js, subjects.PREFILL_STREAMS["short"], await ensure_prefill_consumer(js, "short", model),
                                     max_deliver=5)  # fmt: skip
        (msg,) = await lane.fetch(1, timeout=10.0)
        await msg.ack()
        await lane.close()
        left = (await client.stats()).leased_blocks
        await client.release(filler.lease_id)
        await nc.close()
        return events[rid], decode(GenerateRequest, msg.data), left, filler

    evs, resumed, leased, filler = with_kvpool(nats_server, engine, body)
    assert [(e.seq, e.finish_reason) for e in _sent(evs)] == [(0, None)]  # its first token, and no failure
    assert (resumed.request_id, resumed.resume_token_ids, resumed.resume_seq) == (rid, evs[0].token_ids, 1)
    assert leased == len(filler.blocks)  # the waiting handoff holds no lease


def test_a_request_handed_on_twice_at_the_same_seq_is_not_lost(nats_server, tmp_path):
    """The worker that takes a resume job may stop before its next token: it hands the request on
    at the same seq, a job of its own (the bus would drop a second one under the first's id)."""
    import asyncio

    from llmbus.bus import subjects
    from llmbus.bus.connection import connect
    from llmbus.bus.streams import ensure_streams
    from llmbus.model.demo import make_demo_model
    from llmbus.protocol import encode
    from services.decode.service import DecodeWorker
    from tests.test_decode_worker import _engine, serving, slow_steps
    from tests.test_prefill_worker import _token_events

    model, rid, total = "handon-twice", "handon-twice-0", 16
    model_dir = make_demo_model(tmp_path / "m", "small")
    prompt = list(range(5, 25))
    expected = _tokens(_engine(model_dir), "ref", prompt, SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True))
    first, second = _engine(model_dir), _engine(model_dir)
    slow_steps(first, 0.05)
    slow_steps(second, 1.0)  # stopped before its first step ends
    req = GenerateRequest(rid, model, prompt, token_subject=subjects.tokens(rid), lane="short",
                          sampling=SamplingSpec(max_tokens=total, temperature=0.0, ignore_eos=True))

    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        await ensure_streams(js)
        events, done = await _token_events(nc, lambda ev: ev.request_id == rid and ev.finish_reason is not None)
        async with serving(nats_server, "decode", model, lambda ctx: DecodeWorker(ctx, first, model, drain_s=0)):
            await js.publish(subjects.whole_subject("short", model), encode(req), headers={subjects.MSG_ID_HEADER: rid})
            while len(events.get(rid, ())) < 4:
                await asyncio.sleep(0.01)
        async with serving(nats_server, "decode", model, lambda ctx: DecodeWorker(ctx, second, model, drain_s=0)) as b:
            while rid not in b.active:
                await asyncio.sleep(0.01)
            assert b.handed_on == 0
        assert b.handed_on == 1
        async with serving(nats_server, "decode", model, lambda ctx: DecodeWorker(ctx, _engine(model_dir), model)):
            await asyncio.wait_for(done.wait(), 60)
        await nc.close()
        return events[rid]

    evs = asyncio.run(body())
    sent = [e for e in evs if e.worker]  # (the hand-on notices repeat a seq, from no worker)
    assert [e.seq for e in sent] == list(range(len(sent))) and sent[-1].finish_reason == "length"
    assert [t for e in sent for t in e.token_ids] == expected
    assert len(evs) - len(sent) == 2  # one notice per hand-on


def test_jobs_waiting_to_hand_off_and_resumed_jobs_count_in_the_prompt_budget():
    """Handing off, a job whose first token is out but whose handoff waits for kvpool room still
    holds its KV: its tokens count against the budget, or a worker facing a full kvpool pulls on.
    A resumed job's tokens so far count too: they are computed again."""
    from types import SimpleNamespace

    from services.prefill.service import Job, PrefillWorker

    waiting = Job(None, GenerateRequest("w", "m", [1] * 40), next_seq=1, output_token_ids=[7])
    resumed = Job(None, GenerateRequest("r", "m", [1] * 30, resume_token_ids=[5] * 10, resume_seq=10,
                                        sampling=SamplingSpec(max_tokens=20)), next_seq=10)  # fmt: skip
    decoding = Job(None, GenerateRequest("d", "m", [1] * 50), next_seq=3)
    budget = PrefillWorker.pending_tokens.fget
    outside = SimpleNamespace(prompt_tokens_left=lambda rid: None)  # not admitted yet: counted whole
    assert budget(SimpleNamespace(colocated=False, engine=outside, jobs={"w": waiting, "r": resumed})) == 40 + 40
    # colocated: a job counts until its first token here (then it is decoding)
    assert budget(SimpleNamespace(colocated=True, engine=outside, jobs={"r": resumed, "d": decoding})) == 40
    # admitted: what the engine has yet to compute of it (Engine.prompt_tokens_left)
    inside = SimpleNamespace(prompt_tokens_left=lambda rid: 12)
    assert budget(SimpleNamespace(colocated=True, engine=inside, jobs={"r": resumed, "d": decoding})) == 12
    assert budget(SimpleNamespace(colocated=False, engine=inside, jobs={"w": waiting, "r": resumed})) == 40 + 12
    # a prefix found cached when the job was taken counts out, before the engine schedules it too
    resumed.cached_tokens = 32
    assert budget(SimpleNamespace(colocated=True, engine=outside, jobs={"r": resumed})) == 40 - 32
    assert budget(SimpleNamespace(colocated=True, engine=inside, jobs={"r": resumed})) == 40 - 32
