"""The prefill worker in-process against a real nats-server and a real engine: a burst of jobs
reaches the engine together, so one step prefills them as a batch."""

from __future__ import annotations

import asyncio

from llmbus.bus import subjects
from llmbus.bus.connection import connect
from llmbus.bus.service import ServiceOptions, run_service
from llmbus.bus.streams import ensure_streams
from llmbus.engine.config import EngineConfig
from llmbus.engine.engine import Engine
from llmbus.model.demo import make_demo_model
from llmbus.protocol import GenerateRequest, SamplingSpec, TokenEvent, decode, encode
from services.prefill.service import PrefillWorker

BURST = 6


def test_a_burst_of_jobs_is_prefilled_as_one_batch(nats_server, tmp_path):
    model = "burst"
    engine = Engine.from_model_dir(str(make_demo_model(tmp_path / "m", "small")),
                                   EngineConfig(dtype="float32", device="cpu", enable_prefix_caching=False))
    prompts_per_step: list[int] = []
    step = engine.step

    def counting_step():
        # sequences that have not produced a token yet are prefilling in this step
        prompts_per_step.append(sum(1 for s in engine._seqs.values() if not s.output_token_ids))
        return step()

    engine.step = counting_step

    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        await ensure_streams(js)
        events: dict[str, list[TokenEvent]] = {}
        done = asyncio.Event()

        async def on_token(msg):
            ev = decode(TokenEvent, msg.data)
            events.setdefault(ev.request_id, []).append(ev)
            if sum(1 for evs in events.values() if evs[-1].finish_reason) == BURST:
                done.set()

        await nc.subscribe(subjects.TOKENS_WILDCARD, cb=on_token)
        # the jobs wait in the lane stream before the worker starts: its first fetch gets them all
        for i in range(BURST):
            rid = f"burst-{i}"
            req = GenerateRequest(rid, model, list(range(5 + i, 45 + i)), token_subject=subjects.tokens(rid),
                                  sampling=SamplingSpec(max_tokens=4, temperature=0.0, ignore_eos=True))
            await js.publish(subjects.prefill_subject("short", model), encode(req),
                             headers={subjects.MSG_ID_HEADER: rid})

        holder: dict = {}

        async def service(ctx):
            holder["worker"] = PrefillWorker(ctx, engine, model, colocated=True)
            await holder["worker"].run()

        task = asyncio.create_task(run_service(ServiceOptions("prefill", nats_server, models=(model,)), service))
        try:
            await asyncio.wait_for(done.wait(), 60)
        finally:
            if "worker" in holder:
                holder["worker"].ctx.stop.set()
            assert await asyncio.wait_for(task, 30) == 0
            await nc.close()
        return events

    events = asyncio.run(body())
    assert sorted(events) == [f"burst-{i}" for i in range(BURST)]
    for evs in events.values():
        assert [e.seq for e in evs] == list(range(len(evs)))
        assert sum(len(e.token_ids) for e in evs) == 4 and evs[-1].finish_reason == "length"
    # NOTE: taken one job at a time, each waited for a step boundary, so steps prefilled one prompt each
    assert max(prompts_per_step) >= BURST // 2, prompts_per_step
    assert engine.leak_check()["free_blocks"] == engine.leak_check()["total_blocks"]
