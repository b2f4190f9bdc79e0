"""Conditional disaggregation against a real nats-server and a real engine: the router sends a
short prompt to the decode pool whole, a decode worker prefills and decodes it itself (the same
greedy tokens as an engine run on its own), longer ones still take the prefill lane; a whole
request the engine refuses, or one aborted, ends cleanly."""

from __future__ import annotations

import asyncio
import dataclasses

from llmbus.bus import subjects
from llmbus.bus.connection import connect
from llmbus.bus.streams import ensure_prefill_consumer, ensure_streams
from llmbus.bus.worker import PullWorker
from llmbus.engine.sampling_params import SamplingParams
from llmbus.model.demo import make_demo_model
from llmbus.protocol import Abort, GenerateRequest, SamplingSpec, TokenEvent, decode, encode
from services.decode.service import DecodeWorker
from services.router.policy import RoutingPolicy
from services.router.service import Router
from tests.test_decode_worker import _engine, serving, slow_steps

MODEL = "whole"


def _request(rid: str, prompt: list[int], max_tokens: int) -> GenerateRequest:
    # NOTE: ids no other test on the session's server uses: the lane streams dedup ids for 120 s
    return GenerateRequest(rid, MODEL, prompt, token_subject=subjects.tokens(rid),
                           sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def _events(nc) -> tuple[dict[str, list[TokenEvent]], dict[str, asyncio.Event]]:
    events: dict[str, list[TokenEvent]] = {}
    done: dict[str, asyncio.Event] = {}

    async def on_token(msg):
        ev = decode(TokenEvent, msg.data)
        events.setdefault(ev.request_id, []).append(ev)
        if ev.finish_reason:
            done.setdefault(ev.request_id, asyncio.Event()).set()

    await nc.subscribe(subjects.TOKENS_WILDCARD, cb=on_token)
    return events, done


async def _finished(done: dict[str, asyncio.Event], rid: str) -> None:
    await asyncio.wait_for(done.setdefault(rid, asyncio.Event()).wait(), 60)


def _greedy(engine, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request("ref", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    return out


def test_a_short_prompt_is_prefilled_and_decoded_by_the_decode_pool(nats_server, tmp_path):
    model_dir = make_demo_model(tmp_path / "m", "small")
    short, longer = list(range(5, 25)), list(range(5, 45))
    expected = _greedy(_engine(model_dir), short, 6)

    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        await ensure_streams(js)
        events, done = await _events(nc)
        policy = RoutingPolicy(models=(MODEL,), whole_threshold=32)
        async with serving(nats_server, "decode", MODEL, lambda ctx: DecodeWorker(ctx, _engine(model_dir), MODEL)) as worker:
            async with serving(nats_server, "router", MODEL, lambda ctx: Router(ctx, policy)) as router:
                while not any(i.role == "decode" for i in router.instances):
                    await asyncio.sleep(0.05)
                for rid, prompt, priority in (("whole-short", short, 0), ("whole-longer", longer, 0),
                                              ("whole-urgent", short, -1)):
                    req = dataclasses.replace(_request(rid, prompt, 6), priority=priority)
                    await js.publish(subjects.request_subject(MODEL), encode(req), headers={subjects.MSG_ID_HEADER: rid})
                for rid in ("whole-short", "whole-urgent"):  # the urgent one by the urgent whole queue
                    await _finished(done, rid)
                    evs = events[rid]
                    assert [e.seq for e in evs] == list(range(6)) and {e.worker for e in evs} == {worker.ctx.instance_id}
                    assert [t for e in evs for t in e.token_ids] == expected
                    assert (evs[-1].finish_reason, evs[-1].prompt_tokens, evs[-1].completion_tokens) == ("length", 20, 6)
                assert router.wholes.values == {(MODEL,): 2}
                info = await js.consumer_info(subjects.PREFILL_STREAMS["short"], subjects.urgent_whole_consumer(MODEL))
                assert info.delivered.consumer_seq == 1
            # the longer prompt waits in the prefill lane (no prefill worker here)
            lane = await PullWorker.bind(js, subjects.PREFILL_STREAMS["short"], await ensure_prefill_consumer(js, "short", MODEL),
                                         max_deliver=5)  # fmt: skip
            (msg,) = await lane.fetch(5, timeout=5.0)
            assert decode(GenerateRequest, msg.data).request_id == "whole-longer"
            await msg.ack()
            await lane.close()
            assert "whole-longer" not in events and not worker.active
        await nc.drain()

    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_whole_request_refused_or_aborted_ends_cleanly(nats_server, tmp_path):
    model_dir = make_demo_model(tmp_path / "m", "small")
    engine = _engine(model_dir)
    slow_steps(engine, 0.05)

    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        await ensure_streams(js)
        events, done = await _events(nc)
        async with serving(nats_server, "decode", MODEL, lambda ctx: DecodeWorker(ctx, engine, MODEL)) as worker:
            bad = _request("whole-bad", [5, 6, 10**6], 4)  # a token id past the vocabulary
            other = dataclasses.replace(_request("whole-other", [5, 6], 4), model="zzz")  # on MODEL's queue
            long = _request("whole-long", list(range(5, 25)), 500)
            for req in (bad, other, long):
                await js.publish(subjects.whole_subject("short", MODEL), encode(req), headers={subjects.MSG_ID_HEADER: req.request_id})
            await _finished(done, "whole-bad")
            (ev,) = events["whole-bad"]
            assert (ev.finish_reason, ev.error_code) == ("error", "invalid_request") and "invalid request" in ev.error
            await _finished(done, "whole-other")
            (ev,) = events["whole-other"]
            assert ev.error_code == "invalid_request" and f"serves model {MODEL!r}, not 'zzz'" in ev.error
            while "whole-long" not in events:
                await asyncio.sleep(0.02)
            await nc.publish(subjects.abort("whole-long"), encode(Abort("whole-long")))
            while worker.active or worker.engine.has_unfinished():
                await asyncio.sleep(0.02)
            assert len(events["whole-long"]) < 500 and not any(e.finish_reason for e in events["whole-long"])
            assert worker.engine.num_free_blocks == worker.engine.runner.num_blocks
        await nc.drain()

    asyncio.run(asyncio.wait_for(body(), 120))
