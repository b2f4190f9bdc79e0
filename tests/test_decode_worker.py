"""The decode worker in-process against a real nats-server, a real kvpool process and real engines:
a handoff aborted while the worker reads its blocks from kvpool is dropped, not decoded for nobody."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import torch

from llmbus.bus import subjects
from llmbus.bus.connection import connect
from llmbus.bus.kvclient import KVPoolClient
from llmbus.bus.service import READY_PREFIX, ServiceOptions, run_service
from llmbus.bus.streams import ensure_streams
from llmbus.engine.config import EngineConfig
from llmbus.engine.engine import Engine
from llmbus.kv.formats import kv_block_bytes
from llmbus.engine.sampling_params import SamplingParams
from llmbus.model.demo import make_demo_model
from llmbus.protocol import Abort, GenerateRequest, Handoff, SamplingSpec, TokenEvent, decode, encode
from services.decode.service import DecodeWorker

ROOT = Path(__file__).resolve().parent.parent


def _engine(model_dir: Path) -> Engine:
    return Engine.from_model_dir(str(model_dir), EngineConfig(dtype="float32", device="cpu"))


def _prefilled(engine: Engine, rid: str, prompt: list[int]) -> tuple[dict, torch.Tensor, list[int]]:
    """A prompt prefilled on ``engine`` (prefill_only): its exported state, KV rows and first token."""
    engine.add_request(rid, prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), prefill_only=True)
    while True:
        outs = [o for o in engine.step() if o.request_id == rid]
        if outs and outs[0].finish_reason == "handoff":
            state, kv = engine.export_sequence(rid)
            return state, kv, list(state["output_token_ids"])


def _handed_off(tmp_path, rid: str):
    """Two engines on the small demo model and a prompt prefilled on the first: (that engine, the
    other, the prompt, its exported state, KV rows and first token)."""
    model_dir = make_demo_model(tmp_path / "m", "small")
    source, engine = _engine(model_dir), _engine(model_dir)
    prompt = list(range(7, 47))
    return (source, engine, prompt, *_prefilled(source, rid, prompt))


async def _bus(nats_server: str):
    """A connection, its JetStream context (streams made) and a kvpool client over the bus."""
    nc = await connect(nats_server)
    js = nc.jetstream()
    await ensure_streams(js)
    return nc, js, KVPoolClient(nc, transport="bus")


def slow_steps(engine, seconds: float) -> None:
    """Make each of ``engine``'s steps take ``seconds`` longer: what a request does before some
    other event (a deadline) then no longer depends on how fast the machine is."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.step = slow_step


async def _final_event(nc, rid: str) -> tuple[list[TokenEvent], asyncio.Event]:
    """``rid``'s TokenEvents as they arrive, and an event set by its final one."""
    events: list[TokenEvent] = []
    done = asyncio.Event()

    async def on_token(msg):
        events.append(decode(TokenEvent, msg.data))
        if events[-1].finish_reason:
            done.set()

    await nc.subscribe(subjects.tokens(rid), cb=on_token)
    return events, done


@contextlib.asynccontextmanager
async def serving(nats_server: str, role: str, model: str, make, instance_id: str = ""):
    """The worker ``make(ctx)`` builds, run as a ``role`` service until the block ends; yields it."""
    holder: dict = {}

    async def service(ctx):
        holder["worker"] = make(ctx)
        await holder["worker"].run()

    options = ServiceOptions(role, nats_server, instance_id=instance_id, models=(model,))
    task = asyncio.create_task(run_service(options, service))
    while "worker" not in holder or not holder["worker"].ctx.is_ready:
        assert not task.done(), task.result()
        await asyncio.sleep(0.01)
    try:
        yield holder["worker"]
    finally:
        holder["worker"].ctx.stop.set()
        assert await asyncio.wait_for(task, 30) == 0


def _decode_worker(nats_server: str, engine, model: str):
    return serving(nats_server, "decode", model, lambda ctx: DecodeWorker(ctx, engine, model))


async def _handoff_in_pool(client, engine, model: str, prompt, state, kv, first, deadline: float | None = None,
                           ttl_s: float = 60):
    """The Handoff prefill would publish for ``state``: its KV rows written to a fresh kvpool lease."""
    rid = state["request_id"]
    lease = await client.allocate(kv.shape[0], ttl_s=ttl_s, request_id=rid)
    await client.write_blocks(lease, 0, kv.reshape(kv.shape[0], -1).contiguous().numpy().data)
    req = GenerateRequest(rid, model, prompt, token_subject=subjects.tokens(rid), deadline=deadline,
                          sampling=SamplingSpec(max_tokens=40, temperature=0.0, ignore_eos=True))
    return Handoff(request=req, output_token_ids=first, num_computed_tokens=state["num_computed_tokens"],
                   lease=lease, state=state, kv_shape=list(kv.shape), kv_format=engine.config.kv_format)


def with_kvpool(nats_server: str, engine, body, kvpool_args=()):
    """``asyncio.run(body())`` beside a kvpool process sized for ``engine``'s blocks."""
    kvpool = _start_kvpool(nats_server, kv_block_bytes(engine.layout, engine.config.kv_format), kvpool_args)
    try:
        return asyncio.run(asyncio.wait_for(body(), 120))
    finally:
        _stop(kvpool)


def _start_kvpool(nats_server: str, block_bytes: int, args=()) -> subprocess.Popen:
    kvpool = subprocess.Popen(
        [sys.executable, "-m", "services.kvpool", "--nats-url", nats_server, "--block-bytes", str(block_bytes),
         "--capacity-blocks", "16", "--log-level", "WARNING", *args],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert kvpool.stdout.readline().startswith(f"{READY_PREFIX} kvpool ")
    return kvpool


def _stop(kvpool: subprocess.Popen) -> None:
    kvpool.terminate()
    kvpool.wait(timeout=20)
    kvpool.stdout.close()


def test_a_handoff_aborted_while_its_blocks_are_read_is_dropped(nats_server, tmp_path):
    model, rid = "handoffrace", "doomed"
    source, engine, prompt, state, kv, first = _handed_off(tmp_path, rid)
    imported: list[str] = []
    import_sequence = engine.import_sequence

    def recording_import(state, kv, params):
        imported.append(state.get("request_id", "?"))
        return import_sequence(state, kv, params)

    engine.import_sequence = recording_import
    async def body():
        nc, js, client = await _bus(nats_server)
        handoff = await _handoff_in_pool(client, engine, model, prompt, state, kv, first)
        events: list[TokenEvent] = []

        async def on_token(msg):
            events.append(decode(TokenEvent, msg.data))

        await nc.subscribe(subjects.tokens(rid), cb=on_token)
        holder: dict = {}
        reading, release = asyncio.Event(), asyncio.Event()

        async def service(ctx):
            worker = holder["worker"] = DecodeWorker(ctx, engine, model)
            read_blocks = worker.kv.read_blocks

            async def held_read(*args, **kwargs):  # NOTE: the real read, held until the abort is in
                reading.set()
                await release.wait()
                return await read_blocks(*args, **kwargs)

            worker.kv.read_blocks = held_read
            await worker.run()

        task = asyncio.create_task(run_service(ServiceOptions("decode", nats_server, models=(model,)), service))
        await js.publish(subjects.decode_subject(model), encode(handoff), headers={subjects.MSG_ID_HEADER: rid})
        await asyncio.wait_for(reading.wait(), 30)
        worker = holder["worker"]
        await nc.publish(subjects.abort(rid), encode(Abort(rid, "client_disconnected")))

        async def abort_seen():
            while rid not in worker.recent_aborts:
                await asyncio.sleep(0.005)

        await asyncio.wait_for(abort_seen(), 30)
        release.set()
        for _ in range(200):  # the lease comes back once the take is over
            if (await client.stats()).active_leases == 0:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # steps a wrongly admitted sequence would have decoded in
        assert (await client.stats()).active_leases == 0
        assert rid not in worker.active and imported == []
        worker.ctx.stop.set()
        assert await asyncio.wait_for(task, 30) == 0
        await nc.close()
        return events

    events = with_kvpool(nats_server, engine, body)
    assert events == []  # no token decoded for nobody, no failure for a request its client gave up
    leaks = engine.leak_check()
    assert leaks["requests"] == 0 and leaks["free_blocks"] == leaks["total_blocks"]
    with contextlib.suppress(Exception):
        source.abort(rid)


def test_a_handoff_that_arrives_after_its_abort_gives_its_lease_back(nats_server, tmp_path):
    """A request aborted while its handoff still waits in the decode stream (its client gave up
    during a backlog): the worker that pulls it drops it and releases its lease, which would
    otherwise hold kvpool blocks until the request's deadline."""
    model, rid = "abortedinstream", "aborted-in-stream"
    source, engine, prompt, state, kv, first = _handed_off(tmp_path, rid)

    async def body():
        nc, js, client = await _bus(nats_server)
        handoff = await _handoff_in_pool(client, engine, model, prompt, state, kv, first)
        async with _decode_worker(nats_server, engine, model) as worker:
            await nc.publish(subjects.abort(rid), encode(Abort(rid, "client_disconnected")))
            while rid not in worker.recent_aborts:
                await asyncio.sleep(0.005)
            await js.publish(subjects.decode_subject(model), encode(handoff), headers={subjects.MSG_ID_HEADER: rid})
            for _ in range(500):
                if (await client.stats()).active_leases == 0:
                    break
                await asyncio.sleep(0.02)
            assert (await client.stats()).active_leases == 0 and worker.active == {}
        await nc.close()

    with_kvpool(nats_server, engine, body)
    with contextlib.suppress(Exception):
        source.abort(rid)


def test_a_handoff_whose_lease_is_not_as_kvpool_granted_it_is_refused(nats_server, tmp_path):
    """A handoff comes off the bus: a lease naming blocks kvpool did not grant it (here another
    request's, holding that request's KV) is refused before a byte is read, and released."""
    model, rid = "forgedlease", "forged"
    source, engine, prompt, state, kv, first = _handed_off(tmp_path, rid)
    async def body():
        nc, js, client = await _bus(nats_server)
        own = await client.allocate(kv.shape[0], ttl_s=60, request_id=rid)
        other = await client.allocate(kv.shape[0], ttl_s=60, request_id="someone-else")
        forged = dataclasses.replace(own, blocks=other.blocks)
        req = GenerateRequest(rid, model, prompt, token_subject=subjects.tokens(rid),
                              sampling=SamplingSpec(max_tokens=4, temperature=0.0, ignore_eos=True))
        handoff = Handoff(request=req, output_token_ids=first, num_computed_tokens=state["num_computed_tokens"],
                          lease=forged, state=state, kv_shape=list(kv.shape), kv_format=engine.config.kv_format)
        events, failed = await _final_event(nc, rid)
        async with _decode_worker(nats_server, engine, model):
            await js.publish(subjects.decode_subject(model), encode(handoff), headers={subjects.MSG_ID_HEADER: rid})
            await asyncio.wait_for(failed.wait(), 30)
            for _ in range(100):  # NOTE: the take releases the lease after it sends the failure
                if (stats := await client.stats()).active_leases == 1:
                    break
                await asyncio.sleep(0.05)
        assert await client.release(other.lease_id)  # still the other request's, untouched
        await nc.close()
        return events, stats

    events, stats = with_kvpool(nats_server, engine, body)
    (event,) = events
    assert event.finish_reason == "error"
    assert "is not as kvpool granted it" in event.error
    assert stats.active_leases == 1  # the forged handoff's own lease was released
    leaks = engine.leak_check()
    assert leaks["requests"] == 0 and leaks["free_blocks"] == leaks["total_blocks"]


def test_a_decoding_request_past_its_deadline_is_ended_with_abort(nats_server, tmp_path):
    """Past the gateway's deadline a decode worker ends the request itself, with a final ``abort``
    event, instead of generating to max_tokens for a client that may be gone."""
    model, rid = "decodedeadline", "late"
    source, engine, prompt, state, kv, first = _handed_off(tmp_path, rid)
    slow_steps(engine, 0.05)  # the 40 tokens would take 2 s: the deadline, 1 s away, comes first
    async def body():
        nc, js, client = await _bus(nats_server)
        handoff = await _handoff_in_pool(client, engine, model, prompt, state, kv, first, deadline=time.time() + 1.0)
        events, done = await _final_event(nc, rid)
        async with _decode_worker(nats_server, engine, model) as worker:
            await js.publish(subjects.decode_subject(model), encode(handoff), headers={subjects.MSG_ID_HEADER: rid})
            await asyncio.wait_for(done.wait(), 30)
            await asyncio.sleep(0.3)  # steps a request still running would have published in
            assert worker.active == {}
        await nc.close()
        return events

    events = with_kvpool(nats_server, engine, body)
    assert [e.seq for e in events] == list(range(1, len(events) + 1)) and 1 < len(events) < 40
    assert events[-1].finish_reason == "abort" and "deadline" in events[-1].error
    assert all(e.finish_reason is None for e in events[:-1])
    leaks = engine.leak_check()
    assert leaks["requests"] == 0 and leaks["free_blocks"] == leaks["total_blocks"]
    with contextlib.suppress(Exception):
        source.abort(rid)


def test_a_handoff_ended_by_its_deadline_while_imported_gets_one_final_event(nats_server, tmp_path):
    """The deadline can pass while the handoff is being imported: the worker's abort event is then
    the request's final one, even when the import goes on to fail."""
    model, rid = "importdeadline", "late-import"
    source, engine, prompt, state, kv, first = _handed_off(tmp_path, rid)
    import_sequence = engine.import_sequence

    def slow_failing_import(*args):
        time.sleep(1.6)  # past the deadline and a deadline check
        import_sequence(*args)
        raise RuntimeError("injected: the import failed after all")

    engine.import_sequence = slow_failing_import

    async def body():
        nc, js, client = await _bus(nats_server)
        handoff = await _handoff_in_pool(client, engine, model, prompt, state, kv, first, deadline=time.time() + 0.5)
        events, done = await _final_event(nc, rid)
        async with _decode_worker(nats_server, engine, model):
            await js.publish(subjects.decode_subject(model), encode(handoff), headers={subjects.MSG_ID_HEADER: rid})
            await asyncio.wait_for(done.wait(), 30)
            await asyncio.sleep(1.6)  # the import's end, and what the worker does about it
            assert (await client.stats()).active_leases == 0
        await nc.close()
        return events

    events = with_kvpool(nats_server, engine, body)
    assert [(e.seq, e.finish_reason) for e in events] == [(1, "abort")]
    assert engine.leak_check()["requests"] == 0  # the expiry's abort reached the engine after the import
    with contextlib.suppress(Exception):
        source.abort(rid)


def test_handoffs_wait_for_blocks_instead_of_failing(nats_server, tmp_path):
    """Three handoffs of 3 blocks each (5 as they decode) reach a decode cache of 8: the third waits,
    its KV in kvpool and its lease (2 s, shorter than the wait) renewed, until the first two finish
    free their blocks; then it decodes. Before, it failed: "no free KV blocks to import"."""
    model = "decodewaits"
    model_dir = make_demo_model(tmp_path / "m", "small")
    source = _engine(model_dir)
    engine = Engine.from_model_dir(str(model_dir), EngineConfig(dtype="float32", device="cpu", num_blocks=8))
    slow_steps(engine, 0.1)  # the first two's 39 steps take ~4 s: longer than the third's lease
    rids = ["waits-a", "waits-b", "waits-c"]
    prompts = {rid: list(range(7 + i, 47 + i)) for i, rid in enumerate(rids)}
    prefilled = {rid: _prefilled(source, rid, prompts[rid]) for rid in rids}

    async def body():
        nc, js, client = await _bus(nats_server)
        finals = {rid: await _final_event(nc, rid) for rid in rids}
        async with _decode_worker(nats_server, engine, model) as worker:
            for rid in rids:
                state, kv, first = prefilled[rid]
                handoff = await _handoff_in_pool(client, engine, model, prompts[rid], state, kv, first,
                                                 ttl_s=2 if rid == rids[-1] else 60)
                await js.publish(subjects.decode_subject(model), encode(handoff), headers={subjects.MSG_ID_HEADER: rid})
            for rid in rids:
                await asyncio.wait_for(finals[rid][1].wait(), 60)
            while worker.stores_in_flight:  # each finished request's prefix store holds a lease of its own
                await asyncio.sleep(0.01)
            assert (await client.stats()).active_leases == 0
        await nc.close()
        return {rid: events for rid, (events, _) in finals.items()}

    events = with_kvpool(nats_server, engine, body)
    for rid in rids:
        assert events[rid][-1].finish_reason == "length", events[rid][-1]
        assert sum(len(e.token_ids) for e in events[rid]) == 39  # after the first, which prefill sent
    leaks = engine.leak_check()
    assert leaks["requests"] == 0 and leaks["free_blocks"] == leaks["total_blocks"]


def test_a_handoff_waiting_for_room_at_shutdown_goes_to_another_replica(nats_server, tmp_path):
    """A decode worker that stops while a handoff waits for blocks gives it back to the stream with
    its lease kept: the next replica decodes it, instead of it failing on a released lease."""
    model = "decodehandsback"
    model_dir = make_demo_model(tmp_path / "m", "small")
    source = _engine(model_dir)
    engine = Engine.from_model_dir(str(model_dir), EngineConfig(dtype="float32", device="cpu", num_blocks=8))
    slow_steps(engine, 0.1)
    rids = ["back-a", "back-b", "back-c"]
    prompts = {rid: list(range(7 + i, 47 + i)) for i, rid in enumerate(rids)}
    prefilled = {rid: _prefilled(source, rid, prompts[rid]) for rid in rids}

    async def body():
        nc, js, client = await _bus(nats_server)
        events, done = await _final_event(nc, rids[-1])
        async with _decode_worker(nats_server, engine, model) as worker:
            for rid in rids:
                state, kv, first = prefilled[rid]
                handoff = await _handoff_in_pool(client, engine, model, prompts[rid], state, kv, first)
                await js.publish(subjects.decode_subject(model), encode(handoff), headers={subjects.MSG_ID_HEADER: rid})
            while worker._waiting != [rids[-1]]:
                await asyncio.sleep(0.01)
        # c's lease, kept for the next replica (NOTE: by id: a finished request's best-effort prefix
        # store may still hold a lease of its own as the worker stops)
        assert events == [] and (await client.renew(handoff.lease.lease_id, 60)).lease_id == handoff.lease.lease_id
        other = _engine(model_dir)
        async with _decode_worker(nats_server, other, model) as worker:
            await asyncio.wait_for(done.wait(), 60)
            while worker.stores_in_flight:  # the finished request's prefix store holds a lease of its own
                await asyncio.sleep(0.01)
            assert (await client.stats()).active_leases == 0
        await nc.close()
        return events, other

    events, other = with_kvpool(nats_server, engine, body)
    assert events[-1].finish_reason == "length" and sum(len(e.token_ids) for e in events) == 39
    leaks = other.leak_check()  # (the stopped worker's engine goes with it, a and b still in it)
    assert leaks["requests"] == 0 and leaks["free_blocks"] == leaks["total_blocks"]


def test_best_effort_stores_in_flight_are_bounded(nats_server, tmp_path):
    """Each kvpool store holds a copy of its blocks until kvpool answers: with kvpool slow, a worker
    runs MAX_STORES at once and skips the rest (losing only their reuse), instead of piling them up."""
    from llmbus.worker.base import MAX_STORES

    engine = _engine(make_demo_model(tmp_path / "m", "small"))

    async def body():
        release = asyncio.Event()
        started: list[int] = []

        async def slow_store(i: int) -> None:
            started.append(i)
            await release.wait()

        async with _decode_worker(nats_server, engine, "boundedstores") as worker:
            ran = [worker.spawn_store(slow_store(i)) for i in range(MAX_STORES + 3)]
            await asyncio.sleep(0.1)
            assert ran == [True] * MAX_STORES + [False] * 3 and worker.stores_in_flight == MAX_STORES
            assert sorted(started) == list(range(MAX_STORES))
            release.set()
            await asyncio.sleep(0.1)
            assert worker.stores_in_flight == 0 and worker.spawn_store(slow_store(99))

    asyncio.run(asyncio.wait_for(body(), 60))


def _draining_bus(nats_server: str, tmp_path, model: str, rids: list[str], step_s: float):
    """A decode engine (steps ``step_s`` slower) and each of ``rids`` prefilled on another engine."""
    model_dir = make_demo_model(tmp_path / "m", "small")
    source, engine = _engine(model_dir), _engine(model_dir)
    slow_steps(engine, step_s)
    prompts = {rid: list(range(5 + i, 45 + i)) for i, rid in enumerate(rids)}
    return engine, prompts, {rid: _prefilled(source, rid, prompts[rid]) for rid in rids}


def test_a_stopping_decode_worker_finishes_what_it_holds_and_takes_nothing_new(nats_server, tmp_path):
    """SIGTERM (``ctx.stop``) starts a drain: the request being decoded runs to its end, with no
    error, while a handoff published meanwhile stays in the stream for another replica."""
    model = "decodedrains"
    engine, prompts, prefilled = _draining_bus(nats_server, tmp_path, model, ["drain-a", "drain-late"], 0.05)

    async def body():
        nc, js, client = await _bus(nats_server)
        events, done = await _final_event(nc, "drain-a")
        late_events, late_done = await _final_event(nc, "drain-late")
        handoffs = {rid: await _handoff_in_pool(client, engine, model, prompts[rid], *prefilled[rid]) for rid in prompts}
        async with _decode_worker(nats_server, engine, model) as worker:
            await js.publish(subjects.decode_subject(model), encode(handoffs["drain-a"]), headers={subjects.MSG_ID_HEADER: "drain-a"})
            while len(events) < 3:  # it is decoding
                await asyncio.sleep(0.01)
            worker.ctx.stop.set()  # what SIGTERM does
            while not worker.draining:
                await asyncio.sleep(0.01)
            await js.publish(subjects.decode_subject(model), encode(handoffs["drain-late"]),
                             headers={subjects.MSG_ID_HEADER: "drain-late"})  # fmt: skip
        assert late_events == []
        async with _decode_worker(nats_server, other, model) as worker:
            # NOTE: a bound, not a speed check: a job left delivered to the stopped worker, unacked
            # (a cancelled pull's), would reach this one only after the consumer's 30 s ack wait
            await asyncio.wait_for(late_done.wait(), 20)
            served_by = worker.ctx.instance_id
        await nc.close()
        return events, late_events, served_by

    other = _engine(make_demo_model(tmp_path / "m", "small"))
    events, late_events, served_by = with_kvpool(nats_server, engine, body)
    assert events[-1].finish_reason == "length" and events[-1].error is None
    assert sum(len(e.token_ids) for e in events) == 39  # all but the first token (prefill sent it, seq 0)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert late_events[-1].finish_reason == "length" and {e.worker for e in late_events} == {served_by}


def test_a_second_signal_ends_the_drain(nats_server, tmp_path):
    """``ctx.hurry`` (a second SIGTERM) stops a drain at once: what the worker still holds is
    handed on, a resume job in its lane's prefill queue holding the tokens its client has, so its
    client is not left waiting, nor failed."""
    from llmbus.bus.streams import ensure_prefill_consumer
    from llmbus.bus.worker import PullWorker

    model = "decodehurries"
    engine, prompts, prefilled = _draining_bus(nats_server, tmp_path, model, ["hurry-a"], 0.5)

    async def body():
        nc, js, client = await _bus(nats_server)
        events, done = await _final_event(nc, "hurry-a")
        handoff = await _handoff_in_pool(client, engine, model, prompts["hurry-a"], *prefilled["hurry-a"])
        async with _decode_worker(nats_server, engine, model) as worker:
            await js.publish(subjects.decode_subject(model), encode(handoff), headers={subjects.MSG_ID_HEADER: "hurry-a"})
            while not events:
                await asyncio.sleep(0.01)
            worker.ctx.stop.set()
            while not worker.draining:
                await asyncio.sleep(0.01)
            worker.ctx.hurry.set()
        lane = await PullWorker.bind(js, subjects.PREFILL_STREAMS["short"], await ensure_prefill_consumer(js, "short", model),
                                     max_deliver=5)  # fmt: skip
        (msg,) = await lane.fetch(1, timeout=10.0)
        await msg.ack()
        await lane.close()
        await nc.close()
        return handoff, list(events), decode(GenerateRequest, msg.data), done.is_set()

    handoff, events, resumed, ended = with_kvpool(nats_server, engine, body)
    assert not ended and sum(len(e.token_ids) for e in events) < 39
    assert resumed.request_id == "hurry-a" and resumed.prompt_token_ids == prompts["hurry-a"]
    assert resumed.resume_token_ids == handoff.output_token_ids + [t for e in events for t in e.token_ids]
    assert resumed.resume_seq == events[-1].seq + 1
