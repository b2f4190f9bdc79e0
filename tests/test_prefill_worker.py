"""The prefill worker in-process against a real nats-server and a real engine: a burst of jobs
reaches the engine together, so one step prefills them as a batch; a job aborted before it reaches
the engine never starts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack

from llmbus.bus import subjects
from llmbus.bus.connection import connect
from llmbus.bus.service import READY_PREFIX, ServiceOptions, run_service
from llmbus.bus.streams import ensure_decode_consumer, ensure_streams
from llmbus.engine.config import EngineConfig
from llmbus.engine.engine import Engine
from llmbus.kv.formats import kv_block_bytes
from llmbus.model.demo import make_demo_model
from llmbus.protocol import Abort, GenerateRequest, Handoff, SamplingSpec, TokenEvent, WorkerLoad, decode, encode
from llmbus.protocol.messages import LANES
from services.prefill.service import PrefillWorker

BURST = 6


def _engine(tmp_path, **config) -> Engine:
    return Engine.from_model_dir(str(make_demo_model(tmp_path / "m", "small")),
                                 EngineConfig(dtype="float32", device="cpu", **config))


async def _submit(js, model: str, rid: str, prompt: list[int], max_tokens: int, token_subject: str = "",
                  deadline: float | None = None, priority: int = 0, lane: str = "short") -> None:
    """A request in ``lane``'s queue for its priority (as the router sends it)."""
    req = GenerateRequest(rid, model, prompt, token_subject=token_subject or subjects.tokens(rid), deadline=deadline,
                          sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                          priority=priority)  # fmt: skip
    await js.publish(subjects.lane_subject(lane, model, priority), encode(req), headers={subjects.MSG_ID_HEADER: rid})


async def _bus(nats_server: str):
    """A connection and its JetStream context, the streams made."""
    nc = await connect(nats_server)
    js = nc.jetstream()
    await ensure_streams(js)
    return nc, js


async def _token_events(nc, finished) -> tuple[dict[str, list[TokenEvent]], asyncio.Event]:
    """Every TokenEvent on llmbus.tok.*, by request id; the event is set once ``finished(event)``
    holds for one."""
    events: dict[str, list[TokenEvent]] = {}
    done = asyncio.Event()

    async def on_token(msg):
        ev = decode(TokenEvent, msg.data)
        events.setdefault(ev.request_id, []).append(ev)
        if finished(ev):
            done.set()

    await nc.subscribe(subjects.TOKENS_WILDCARD, cb=on_token)
    return events, done


async def _handing_off_bus(nats_server: str, model: str):
    """A connection, its JetStream context (streams and ``model``'s decode consumer made) and a
    kvpool client over the bus."""
    from llmbus.bus.kvclient import KVPoolClient

    nc = await connect(nats_server)
    js = nc.jetstream()
    await ensure_streams(js)
    await ensure_decode_consumer(js, model)
    return nc, js, KVPoolClient(nc, transport="bus")


def _colocated_worker(nats_server: str, engine: Engine, model: str, colocated: bool = True):
    """A PrefillWorker (colocated unless told) run as a service until the block ends; yields the worker."""
    from tests.test_decode_worker import serving

    return serving(nats_server, "prefill", model, lambda ctx: PrefillWorker(ctx, engine, model, colocated=colocated))


def test_a_burst_of_jobs_is_prefilled_as_one_batch(nats_server, tmp_path):
    model = "burst"
    engine = _engine(tmp_path, enable_prefix_caching=False)
    prompts_per_step: list[int] = []
    step = engine.step

    def counting_step():
        # sequences that have not produced a token yet are prefilling in this step
        prompts_per_step.append(sum(1 for s in engine._seqs.values() if not s.output_token_ids))
        return step()

    engine.step = counting_step

    async def body():
        nc, js = await _bus(nats_server)
        def all_finished(_) -> bool:
            return sum(1 for evs in events.values() if evs[-1].finish_reason) == BURST

        events, done = await _token_events(nc, all_finished)
        # the jobs wait in the lane stream before the worker starts: its first fetch gets them all
        for i in range(BURST):
            await _submit(js, model, f"burst-{i}", list(range(5 + i, 45 + i)), 4)
        async with _colocated_worker(nats_server, engine, model):
            await asyncio.wait_for(done.wait(), 60)
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


def test_a_burst_of_long_prompts_is_pulled_only_up_to_the_token_budget(nats_server, tmp_path):
    """A worker pulls prompts while those waiting for their first token fill less than two steps'
    token budget: a burst queued before it looked stays in the stream past that (where another
    replica can take it), however many batch slots are free."""
    model = "budget"
    engine = _engine(tmp_path, enable_prefix_caching=False, max_num_batched_tokens=64)

    async def body():
        nc, js = await _bus(nats_server)
        # NOTE: one subscription, so its callbacks run in the order the worker sent (loads, tokens)
        seen: list[tuple[str, object]] = []
        finished: set[str] = set()
        done = asyncio.Event()

        async def on_msg(msg):
            if msg.subject.startswith(subjects.load("x")[:-1]):
                seen.append(("load", decode(WorkerLoad, msg.data)))
            elif msg.subject.startswith(subjects.tokens("x")[:-1]):
                ev = decode(TokenEvent, msg.data)
                seen.append(("token", ev))
                if ev.finish_reason:
                    finished.add(ev.request_id)
                    if len(finished) == BURST:
                        done.set()

        await nc.subscribe(f"{subjects.PREFIX}.>", cb=on_msg)
        for i in range(BURST):  # NOTE: in both lanes: each lane's pull loop counts the other's pull
            await _submit(js, model, f"budget-{i}", list(range(3 + i, 103 + i)), 2, lane=LANES[i % 2])
        async with _colocated_worker(nats_server, engine, model) as worker:
            await asyncio.wait_for(done.wait(), 60)
            iid = worker.ctx.instance_id
        await nc.close()
        first_token = next(i for i, (kind, _) in enumerate(seen) if kind == "token")
        held = [load.requests for kind, load in seen[:first_token] if kind == "load" and load.instance_id == iid]
        return finished, held

    finished, held = asyncio.run(body())
    assert finished == {f"budget-{i}" for i in range(BURST)}
    # two 100-token prompts fill two 64-token steps: the rest wait in the streams until a first
    # token. The other lane's pull may have had a fetch in flight when the budget filled (one job
    # more); counting only its own pull, each lane's loop took two (four)
    assert 2 <= max(held) <= 3, held


def test_urgent_jobs_are_taken_ahead_of_a_backlog_queued_before_them(nats_server, tmp_path):
    """One batch slot, five jobs waiting when the worker starts, the two urgent ones queued last:
    each goes into the first room that frees (a job in flight when the worker started may share
    it), so both start before every job queued before them but one; FIFO, they would run last."""
    model = "urgent"
    engine = _engine(tmp_path, enable_prefix_caching=False, max_num_seqs=1)

    async def body():
        nc, js = await _bus(nats_server)
        order: list[str] = []

        def finished(ev) -> bool:
            if ev.seq == 0:
                order.append(ev.request_id)
            return len(order) == 5 and all(evs[-1].finish_reason for evs in events.values())

        events, done = await _token_events(nc, finished)
        for i in range(3):
            await _submit(js, model, f"urgent-n{i}", list(range(5 + i, 25 + i)), 3)
        for i in range(2):
            await _submit(js, model, f"urgent-u{i}", list(range(50 + i, 70 + i)), 3, priority=-1 - i)
        async with _colocated_worker(nats_server, engine, model):
            await asyncio.wait_for(done.wait(), 60)
        await nc.close()
        return order, events

    order, events = asyncio.run(body())
    assert sorted(order) == ["urgent-n0", "urgent-n1", "urgent-n2", "urgent-u0", "urgent-u1"]
    assert {"urgent-u0", "urgent-u1"} <= set(order[:3]), order
    assert all(evs[-1].finish_reason == "length" for evs in events.values())
    assert engine.leak_check()["free_blocks"] == engine.leak_check()["total_blocks"]


def test_a_worker_whose_engine_thread_dies_exits_with_a_failure(nats_server, tmp_path):
    """An engine whose steps raise whatever they run (a dead device; a step that fails on one
    request alone ends only that request, tests/test_step_failures.py): the worker stops and exits
    1, so ``llmbus up`` or a supervisor sees a failure, not a clean stop."""
    model = "dies"
    engine = _engine(tmp_path, enable_prefix_caching=False)

    def broken_step():
        raise RuntimeError("a step that cannot be taken")

    engine.step = broken_step

    async def body():
        nc, js = await _bus(nats_server)
        await _submit(js, model, "dies-0", list(range(5, 25)), 3)
        code = await asyncio.wait_for(run_service(ServiceOptions("prefill", nats_server, models=(model,)),
                                                  lambda ctx: PrefillWorker(ctx, engine, model, colocated=True).run()), 60)
        await nc.close()
        return code

    assert asyncio.run(body()) == 1


def test_a_short_prompt_is_handed_off_before_a_long_one_prefilled_with_it(nats_server, tmp_path):
    """Handoffs of one step leave shortest prompt first: the short one's first token is out, and
    its second should not wait behind the long one's KV (export, lease, copy) in the queues they
    share (the engine thread, kvpool)."""
    model = "order"
    engine = _engine(tmp_path, enable_prefix_caching=False)
    # NOTE: the order under test is within one step, so the engine idles until both are in (on a
    # loaded machine the short one's admission could otherwise miss the long one's step)
    added: set[str] = set()
    step, add_request = engine.step, engine.add_request
    deadline = time.monotonic() + 60

    def add_and_note(rid, *args, **kwargs):
        out = add_request(rid, *args, **kwargs)
        added.add(rid)
        return out

    def step_once_both_are_in():
        if len(added) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
            return []
        return step()

    engine.step, engine.add_request = step_once_both_are_in, add_and_note
    kvpool = subprocess.Popen(
        [sys.executable, "-m", "services.kvpool", "--nats-url", nats_server, "--block-bytes",
         str(kv_block_bytes(engine.layout, "model")), "--capacity-blocks", "64", "--log-level", "WARNING"],
        cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert kvpool.stdout.readline().startswith(f"{READY_PREFIX} kvpool ")

    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        await ensure_streams(js, models=(model,))
        handoffs = await js.pull_subscribe_bind(await ensure_decode_consumer(js, model), stream=subjects.DECODE_STREAM)
        # long first: both wait in the lane before the worker starts
        await _submit(js, model, "long", [3 + i % 1500 for i in range(600)], 4)
        await _submit(js, model, "short", list(range(3, 11)), 4)
        msgs = []
        async with _colocated_worker(nats_server, engine, model, colocated=False):
            while len(msgs) < 2:
                with contextlib.suppress(asyncio.TimeoutError):
                    msgs += await handoffs.fetch(2 - len(msgs), timeout=5)
        for m in msgs:
            await m.ack()
        await nc.close()
        return [decode(Handoff, m.data).request.request_id for m in msgs]  # in stream order

    try:
        assert asyncio.run(asyncio.wait_for(body(), 120)) == ["short", "long"]
    finally:
        kvpool.terminate()
        kvpool.wait(timeout=20)
        kvpool.stdout.close()


def test_a_job_aborted_while_its_prefix_is_looked_up_never_starts(nats_server, tmp_path):
    model = "abortrace"
    engine = _engine(tmp_path)
    added: list[str] = []
    step, add_request = engine.step, engine.add_request

    hold, released = threading.Event(), threading.Event()

    def slow_step():
        time.sleep(0.15)  # NOTE: long steps hold the job at the prefix lookup, which waits for a step boundary
        if hold.is_set():  # NOTE: and, whatever the machine's load, until the abort is in
            released.wait(30)
        return step()

    def recording_add(rid, *args, **kwargs):
        added.append(rid)
        return add_request(rid, *args, **kwargs)

    engine.step, engine.add_request = slow_step, recording_add

    async def body():
        nc, js = await _bus(nats_server)
        first_token, finished = asyncio.Event(), asyncio.Event()

        async def on_token(msg):
            ev = decode(TokenEvent, msg.data)
            if ev.request_id == "busy":
                first_token.set()
                if ev.finish_reason:
                    finished.set()

        await nc.subscribe(subjects.TOKENS_WILDCARD, cb=on_token)
        async with _colocated_worker(nats_server, engine, model) as worker:
            await _submit(js, model, "busy", list(range(7, 47)), 12)  # keeps the engine stepping
            await asyncio.wait_for(first_token.wait(), 30)
            hold.set()
            await _submit(js, model, "doomed", list(range(7, 47)), 8)
            while "doomed" not in worker.jobs:
                await asyncio.sleep(0.002)
            await nc.publish(subjects.abort("doomed"), encode(Abort("doomed", "client_disconnected")))
            while "doomed" in worker.jobs:  # the abort taken (the job popped), its admission still to come
                await asyncio.sleep(0.002)
            released.set()
            await asyncio.wait_for(finished.wait(), 30)
            await asyncio.sleep(0.5)  # a few more step boundaries: a late admission would have happened
            assert "doomed" not in worker.jobs
        await nc.close()

    asyncio.run(body())
    assert added == ["busy"]
    leaks = engine.leak_check()
    assert leaks["requests"] == 0 and leaks["free_blocks"] == leaks["total_blocks"]


def test_a_job_that_fails_for_any_reason_ends_with_an_error_and_frees_its_place(nats_server, tmp_path):
    """Not only a bad request (ValueError) ends a job before it reaches the engine: anything that
    goes wrong there ends it with an error event, instead of leaving it in the worker's jobs, holding
    a place and its stream message, while its client waits for ever."""
    model = "takefails"
    engine = _engine(tmp_path)
    local_prefix_blocks = engine.local_prefix_blocks

    def failing_once(hashes):
        engine.local_prefix_blocks = local_prefix_blocks
        raise RuntimeError("injected failure")

    engine.local_prefix_blocks = failing_once

    async def body():
        nc, js = await _bus(nats_server)
        events, done = await _token_events(nc, lambda ev: ev.request_id == "next" and ev.finish_reason is not None)
        async with _colocated_worker(nats_server, engine, model) as worker:
            await _submit(js, model, "unlucky", list(range(7, 47)), 4)

            async def failed():
                while not events.get("unlucky"):
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(failed(), 30)
            await _submit(js, model, "too-long", [7] * engine.max_model_len, 4)
            # another model's request on this model's queue (a tool's, past the router's check)
            other = GenerateRequest("other-model", "zzz", [7, 8], token_subject=subjects.tokens("other-model"))
            await js.publish(subjects.lane_subject("short", model, 0), encode(other))
            # a payload that is no request but names one: its client hears why, as from the router
            garbage = msgpack.packb({"request_id": "garbled", "model": model, "prompt_token_ids": "seven"})
            await js.publish(subjects.lane_subject("short", model, 0), garbage)
            await _submit(js, model, "next", list(range(7, 47)), 4)
            await asyncio.wait_for(done.wait(), 30)
            assert worker.jobs == {}
        (failure,) = events["unlucky"]
        assert failure.finish_reason == "error" and "injected failure" in failure.error
        assert failure.error_code == ""  # ours: the gateway answers 500
        (failure,) = events["too-long"]
        assert failure.finish_reason == "error" and "context" in failure.error
        assert failure.error_code == "invalid_request"  # the request's: the gateway answers 400
        (failure,) = events["other-model"]
        assert "serves model 'takefails', not 'zzz'" in failure.error and failure.error_code == "invalid_request"
        (failure,) = events["garbled"]
        assert failure.error.startswith("malformed request: GenerateRequest.prompt_token_ids")
        assert failure.error_code == "invalid_request"
        assert [len(e.token_ids) for e in events["next"]] == [1, 1, 1, 1]
        name = subjects.prefill_consumer("short", model)
        info = await js.consumer_info(subjects.PREFILL_STREAMS["short"], name)
        assert info.num_ack_pending == 0 and info.num_pending == 0
        await nc.close()

    asyncio.run(body())
    leaks = engine.leak_check()
    assert leaks["requests"] == 0 and leaks["free_blocks"] == leaks["total_blocks"]


def test_a_handoff_without_a_kvpool_fails_its_job_in_one_line(tmp_path, caplog):
    """No kvpool answering (down, restarting): each job fails at once with a clear error to its
    client and one warning line in the log, not a traceback per job."""
    from llmbus.bus.server import EmbeddedNats

    model = "nopool"
    engine = _engine(tmp_path)

    async def body(url):
        nc, js = await _bus(url)
        await ensure_decode_consumer(js, model)
        events, done = await _token_events(nc, lambda ev: ev.finish_reason is not None)
        async with _colocated_worker(url, engine, model, colocated=False):
            await _submit(js, model, "lonely", list(range(7, 47)), 4)
            await asyncio.wait_for(done.wait(), 60)
        await nc.close()
        return events

    with EmbeddedNats(tmp_path / "nats") as server, caplog.at_level(logging.WARNING, "llmbus"):
        events = asyncio.run(body(server.url))
    last = events["lonely"][-1]
    assert last.finish_reason == "error" and "kvpool allocate got no answer" in last.error
    (record,) = [r for r in caplog.records if "prefill of lonely failed" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.exc_info is None
    leaks = engine.leak_check()
    assert leaks["requests"] == 0 and leaks["free_blocks"] == leaks["total_blocks"]


def test_a_job_aborted_during_its_handoff_ends_quietly(nats_server, tmp_path, caplog):
    """A gateway aborts a request as soon as a stop string ends it, often on its first token, while
    the prefill worker is handing it off: the worker stops there, without a failure event, an ERROR
    or a leaked block (it acked the job when it took the abort, and used to ack it again)."""
    model = "handoffabort"
    engine = _engine(tmp_path, enable_prefix_caching=False)
    released = threading.Event()
    export = engine.export_sequence

    def export_after_the_abort(rid):
        released.wait(30)  # NOTE: the engine thread waits here until the worker has taken the abort
        return export(rid)

    engine.export_sequence = export_after_the_abort

    async def body():
        nc, js = await _bus(nats_server)
        events: list[TokenEvent] = []
        first = asyncio.Event()

        async def on_token(msg):
            events.append(decode(TokenEvent, msg.data))
            first.set()

        await nc.subscribe(subjects.tokens("cut"), cb=on_token)
        async with _colocated_worker(nats_server, engine, model, colocated=False) as worker:
            await _submit(js, model, "cut", list(range(7, 47)), 8)
            await asyncio.wait_for(first.wait(), 30)
            await nc.publish(subjects.abort("cut"), encode(Abort("cut", "stop_string")))
            while "cut" in worker.jobs:
                await asyncio.sleep(0.002)
            released.set()
            for _ in range(100):  # the abort's engine call done
                if not engine.leak_check()["requests"]:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # the handoff task's end
        await nc.close()
        return events

    with caplog.at_level("DEBUG", logger="llmbus.prefill"):
        events = asyncio.run(asyncio.wait_for(body(), 60))
    assert [e.finish_reason for e in events] == [None], events  # the first token only: no failure
    assert not [r for r in caplog.records if r.name == "llmbus.prefill" and r.levelno >= logging.WARNING], caplog.text
    leaks = engine.leak_check()
    assert leaks["requests"] == 0 and leaks["free_blocks"] == leaks["total_blocks"]


def test_a_handoff_the_decode_stream_already_has_gives_its_lease_back(nats_server, tmp_path):
    """A job redelivered after its handoff went out is handed off again; the decode stream drops the
    second as a duplicate (same Nats-Msg-Id), so nobody will read or release its lease: prefill does
    at once, instead of leaving the blocks taken until the lease expires (120 s)."""
    from tests.test_decode_worker import with_kvpool

    model, rid = "duphandoff", "dup"
    engine = _engine(tmp_path, enable_prefix_caching=False)

    async def body():
        nc, js, client = await _handing_off_bus(nats_server, model)
        # the first handoff of this request, already in the decode stream
        await js.publish(subjects.decode_subject(model), b"the first handoff", headers={subjects.MSG_ID_HEADER: rid})
        events, first = await _token_events(nc, lambda ev: ev.request_id == rid)
        async with _colocated_worker(nats_server, engine, model, colocated=False) as worker:
            await _submit(js, model, rid, list(range(7, 47)), 8)
            await asyncio.wait_for(first.wait(), 30)
            while rid in worker.jobs:  # until the handoff is over (its job acked)
                await asyncio.sleep(0.01)
            assert (await client.stats()).active_leases == 0
        assert [e.finish_reason for e in events[rid]] == [None]
        await nc.close()

    with_kvpool(nats_server, engine, body)


def test_a_handoff_waits_while_kvpool_is_full_and_its_lease_lasts_to_the_deadline(nats_server, tmp_path):
    """kvpool full (decode is behind, its handoffs' leases wait in the stream): the prefilled job
    waits for room, holding its place in this worker, instead of failing with "kvpool has 0 free
    blocks"; once room appears it hands off, with a lease that lasts until the request's deadline
    (plus the usual TTL; at most kvpool's --max-ttl), not 120 s: the handoff may wait in the decode
    stream that long. A deadline that passes while it waits ends it with ``abort``."""
    from tests.test_decode_worker import with_kvpool

    model, rid = "kvpoolfull", "waits-for-kvpool"
    engine = _engine(tmp_path, enable_prefix_caching=False)

    def final(events, rid):
        async def wait():
            while not any(e.finish_reason for e in events.get(rid, [])):
                await asyncio.sleep(0.01)
            return events[rid][-1]

        return asyncio.wait_for(wait(), 30)

    async def body():
        nc, js, client = await _handing_off_bus(nats_server, model)
        filler = await client.allocate((await client.stats()).free_blocks, ttl_s=60)
        events, first = await _token_events(nc, lambda ev: ev.request_id == rid)
        deadline = time.time() + 1000
        async with _colocated_worker(nats_server, engine, model, colocated=False) as worker:
            await _submit(js, model, rid, list(range(7, 47)), 8, deadline=deadline)
            await asyncio.wait_for(first.wait(), 30)
            await asyncio.sleep(0.5)  # a few retries
            assert rid in worker.jobs and [e.finish_reason for e in events[rid]] == [None]
            await client.release(filler.lease_id)
            while rid in worker.jobs:  # until the handoff is out (its job acked)
                await asyncio.sleep(0.01)
            handoff = decode(Handoff, (await js.get_last_msg(subjects.DECODE_STREAM, subjects.decode_subject(model))).data)
            assert handoff.request.request_id == rid and handoff.lease.ttl_s == 900  # kvpool's --max-ttl
            await client.release(handoff.lease.lease_id)
            assert [e.finish_reason for e in events[rid]] == [None]
            # KV larger than kvpool's whole capacity (16 blocks) never fits: it fails at once, no wait
            await _submit(js, model, "too-big-for-kvpool", list(range(7, 307)), 8, deadline=deadline)
            assert "exceed kvpool's whole capacity" in (await final(events, "too-big-for-kvpool")).error
            # full again, and the deadline passes while the job waits
            filler = await client.allocate((await client.stats()).free_blocks, ttl_s=60)
            await _submit(js, model, "waits-past-deadline", list(range(7, 47)), 8, deadline=time.time() + 1.0)
            ended = await final(events, "waits-past-deadline")
            assert (ended.seq, ended.finish_reason) == (1, "abort") and "deadline" in ended.error
            await client.release(filler.lease_id)
            while worker.jobs:
                await asyncio.sleep(0.01)
        await nc.close()

    with_kvpool(nats_server, engine, body, kvpool_args=["--max-ttl", "900"])


def test_a_job_whose_ack_fails_after_its_handoff_is_not_failed(nats_server, tmp_path, monkeypatch):
    """Once the handoff is out, decode has the request: an ack that fails then (NATS reconnecting)
    must not send the client an error event, which would end its stream, and so its abort, while
    decode generates on for nobody."""
    from nats.aio.msg import Msg

    from llmbus.bus.kvclient import KVPoolClient
    from tests.test_decode_worker import with_kvpool

    model, rid = "ackfails", "unacked"
    engine = _engine(tmp_path, enable_prefix_caching=False)
    ack = Msg.ack

    async def failing_ack(msg):
        if msg.subject == subjects.prefill_subject("short", model):
            raise ConnectionError("injected: the connection dropped")
        return await ack(msg)

    monkeypatch.setattr(Msg, "ack", failing_ack)

    async def body():
        nc, js = await _bus(nats_server)
        handoffs = await js.pull_subscribe_bind(await ensure_decode_consumer(js, model), stream=subjects.DECODE_STREAM)
        events, first = await _token_events(nc, lambda ev: ev.request_id == rid)
        async with _colocated_worker(nats_server, engine, model, colocated=False) as worker:
            await _submit(js, model, rid, list(range(7, 47)), 8)
            await asyncio.wait_for(first.wait(), 30)
            while rid in worker.jobs:
                await asyncio.sleep(0.01)
            (msg,) = await handoffs.fetch(1, timeout=10)
            handoff = decode(Handoff, msg.data)
            await msg.ack()
            await asyncio.sleep(0.2)
        assert [e.finish_reason for e in events[rid]] == [None]  # the first token, and no failure
        await KVPoolClient(nc, transport="bus").release(handoff.lease.lease_id)
        await nc.close()

    with_kvpool(nats_server, engine, body)


def test_a_colocated_request_past_its_deadline_is_ended_with_abort(nats_server, tmp_path):
    """The gateway's deadline bounds how long a request runs when its client is gone and the abort
    was lost: past it, the worker ends the request with a final ``abort`` event and frees it."""
    from tests.test_decode_worker import slow_steps

    model, rid = "deadline", "late"
    engine = _engine(tmp_path)
    slow_steps(engine, 0.05)  # 400 tokens would take 20 s: the 1 s deadline comes first

    async def body():
        nc, js = await _bus(nats_server)
        events, done = await _token_events(nc, lambda ev: ev.finish_reason is not None)
        async with _colocated_worker(nats_server, engine, model) as worker:
            req = GenerateRequest(rid, model, list(range(7, 47)), token_subject=subjects.tokens(rid),
                                  sampling=SamplingSpec(max_tokens=400, temperature=0.0, ignore_eos=True),
                                  deadline=time.time() + 1.0)
            await js.publish(subjects.prefill_subject("short", model), encode(req), headers={subjects.MSG_ID_HEADER: rid})
            await asyncio.wait_for(done.wait(), 30)
            await asyncio.sleep(0.3)  # steps a request still running would have published in
            assert worker.jobs == {}
            info = await js.consumer_info(subjects.PREFILL_STREAMS["short"], subjects.prefill_consumer("short", model))
            assert info.num_ack_pending == 0
        await nc.close()
        return events[rid]

    evs = asyncio.run(asyncio.wait_for(body(), 60))
    assert [e.seq for e in evs] == list(range(len(evs))) and 1 < len(evs) < 400
    assert evs[-1].finish_reason == "abort" and "deadline" in evs[-1].error
    assert all(e.finish_reason is None for e in evs[:-1])
    leaks = engine.leak_check()
    assert leaks["requests"] == 0 and leaks["free_blocks"] == leaks["total_blocks"]


def test_an_engine_keeps_the_bytes_of_what_it_evicts(tmp_path):
    """keep_evicted: an evicted prefix block's bytes are copied before another sequence reuses it."""
    import torch

    from llmbus.engine.sampling_params import SamplingParams
    from services.prefill.service import _chains

    engine = _engine(tmp_path, num_blocks=6)
    engine.keep_evicted()
    bs = engine.layout.block_size
    first = list(range(5, 5 + 4 * bs + 3))  # 4 full blocks and a partial one
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def run(rid, prompt):
        engine.add_request(rid, prompt, params)
        while engine.has_unfinished():
            engine.step()

    run("a", first)
    hashes = engine.prefix_hashes(first[: 4 * bs])
    before = engine.export_cached(hashes)
    assert before.shape[0] == 4 and engine.num_evicted == 0
    run("b", list(range(500, 500 + 5 * bs)))  # needs 5 of the 6 blocks: evicts a's cached blocks
    evicted = engine.take_evicted()
    assert engine.num_evicted == 0 and len(evicted) >= 3
    [chain] = _chains(evicted)  # one chain, from its first evicted block on
    got = {h: row for h, _, row in chain}
    for i, h in enumerate(hashes):
        if h in got:
            assert torch.equal(got[h], before[i]), f"block {i} changed before it was saved"
    assert [h for h, _, _ in chain] == [h for h in hashes if h in got]
    # b took the two never-cached blocks, then evicted a's blocks tail first down to its second:
    # the chain starts mid-prompt and names the block before it as its parent
    first = hashes.index(chain[0][0])
    assert first == 1 and chain[0][1] == hashes[0]


def test_chains_come_out_first_block_first_and_branches_stay_stored():
    from services.prefill.service import _chains

    ev = lambda h, p: (h, p, None)  # noqa: E731
    # two sequences' tails, tail first and interleaved; x2 branches off the same parent as a2
    evicted = [ev("a3", "a2"), ev("b2", "b1"), ev("a2", "a1"), ev("x2", "a1"), ev("b1", "root")]
    chains = [[h for h, _, _ in c] for c in _chains(evicted)]
    assert sorted(chains) == [["a2", "a3"], ["b1", "b2"], ["x2"]]
    assert sum(len(c) for c in chains) == len(evicted)


def test_evicted_blocks_nobody_drains_are_capped(tmp_path):
    from llmbus.engine.sampling_params import SamplingParams

    engine = _engine(tmp_path, num_blocks=6)
    engine.keep_evicted()
    bs = engine.layout.block_size
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(30):  # each prompt evicts the previous one's four cached blocks
        engine.add_request(f"r{i}", list(range(10 + 7 * i, 10 + 7 * i + 4 * bs + 1)), params)
        while engine.has_unfinished():
            engine.step()
    assert engine.num_evicted == 64  # the floor of the cap (a quarter of a larger cache)
    assert len(engine.take_evicted()) == 64 and engine.num_evicted == 0


def test_a_stopping_colocated_worker_finishes_its_requests_and_says_it_has_no_room(nats_server, tmp_path):
    """At SIGTERM a colocated worker lets the request it decodes run to its end, and its load
    report says room 0 at once, so routers send it nothing more by name."""
    from tests.test_decode_worker import slow_steps

    model = "drainco"
    engine = _engine(tmp_path, enable_prefix_caching=False)
    slow_steps(engine, 0.03)

    async def body():
        nc, js = await _bus(nats_server)
        events, done = await _token_events(nc, lambda ev: ev.finish_reason is not None)
        loads: list[WorkerLoad] = []

        async def on_load(msg):
            loads.append(decode(WorkerLoad, msg.data))

        await nc.subscribe(subjects.LOADS_WILDCARD, cb=on_load)
        async with _colocated_worker(nats_server, engine, model) as worker:
            await _submit(js, model, "drainco-1", list(range(3, 43)), 30)
            while len(events.get("drainco-1", [])) < 3:  # decoding
                await asyncio.sleep(0.01)
            worker.ctx.stop.set()  # what SIGTERM does
            await asyncio.wait_for(done.wait(), 60)
            iid = worker.ctx.instance_id
        await nc.close()
        return events["drainco-1"], [load for load in loads if load.instance_id == iid]

    evs, loads = asyncio.run(body())
    assert evs[-1].finish_reason == "length" and evs[-1].error is None
    assert sum(len(e.token_ids) for e in evs) == 30 and [e.seq for e in evs] == list(range(len(evs)))
    assert (loads[-2].requests, loads[-2].room) == (1, 0) and loads[-1] == WorkerLoad(loads[-1].instance_id, 0, 0)
