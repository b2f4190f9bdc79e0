"""Routing by cached prefix, against a real nats-server, a real kvpool and real engines: prefill
workers announce what their caches hold (KV events), the router asks kvpool's index where a prompt
is cached and sends it to that worker's direct subject; what waits for a worker that went away
goes back to the lane."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from nats.js.errors import NotFoundError

from llmbus.bus import subjects
from llmbus.bus.connection import connect
from llmbus.bus.kvclient import KVPoolClient
from llmbus.bus.streams import ensure_streams
from llmbus.engine.config import EngineConfig
from llmbus.engine.engine import Engine
from llmbus.kv.formats import kv_block_bytes
from llmbus.model.demo import make_demo_model
from llmbus.protocol import GenerateRequest, SamplingSpec, TokenEvent, WorkerLoad, decode, encode
from llmbus.protocol.messages import BlockRemovedEvent, BlockStoredEvent, KVEvents
from llmbus.worker.events import cache_events
from services.kvpool.config import format_layout
from services.prefill.service import PrefillWorker
from services.router.policy import RoutingPolicy
from services.router.service import Router
from tests.test_decode_worker import _start_kvpool, _stop, serving

MODEL = "kvr"
PREFIX_TOKENS = 160  # ten 16-token blocks


def test_cache_changes_become_kv_events_last_change_winning():
    a, b, c, d = (bytes([i]) * 16 for i in range(1, 5))
    assert cache_events("w", [], 16) is None
    changes = [(True, a, None), (True, b, a), (False, c, None), (True, c, b), (True, d, None), (False, d, None)]
    assert cache_events("w", changes, 16) == KVEvents("w", [BlockStoredEvent([a, b, c], None, 16, "t0", "w")],
                                                      [BlockRemovedEvent([d], "t0", "w")])  # fmt: skip
    # a block stored again after its removal is stored; one whose parent left the batch starts a chain
    changes = [(True, a, None), (False, a, None), (True, b, None), (True, a, None)]
    assert cache_events("w", changes, 16) == KVEvents("w", [BlockStoredEvent([b], None, 16, "t0", "w"),
                                                            BlockStoredEvent([a], None, 16, "t0", "w")])  # fmt: skip


def _request(rid: str, prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(rid, MODEL, prompt, token_subject=subjects.tokens(rid),
                           sampling=SamplingSpec(max_tokens=3, temperature=0.0, ignore_eos=True))


async def _finals(nc) -> dict[str, asyncio.Future]:
    """Each request's final TokenEvent, as a future created on first use."""
    finals: dict[str, asyncio.Future] = {}
    loop = asyncio.get_running_loop()

    async def on_token(msg):
        ev = decode(TokenEvent, msg.data)
        fut = finals.setdefault(ev.request_id, loop.create_future())
        if ev.finish_reason and not fut.done():
            fut.set_result(ev)

    await nc.subscribe(subjects.TOKENS_WILDCARD, cb=on_token)
    return finals


async def _final(finals: dict[str, asyncio.Future], rid: str, timeout: float = 60) -> TokenEvent:
    fut = finals.setdefault(rid, asyncio.get_running_loop().create_future())
    return await asyncio.wait_for(fut, timeout)


@contextlib.asynccontextmanager
async def _router(url: str, policy: RoutingPolicy, prefill_workers: int):
    """A Router service, yielded once its registry snapshot shows ``prefill_workers`` workers."""
    async with serving(url, "router", MODEL, lambda ctx: Router(ctx, policy)) as router:
        while sum(i.role == "prefill" for i in router.instances) < prefill_workers:
            await asyncio.sleep(0.05)
        yield router


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("kvr") / "m", "small")


def _engine(model_dir) -> Engine:
    return Engine.from_model_dir(str(model_dir), EngineConfig(dtype="float32", device="cpu"))


def _worker(url: str, engine: Engine, instance_id: str):
    return serving(url, "prefill", MODEL, lambda ctx: PrefillWorker(ctx, engine, MODEL, colocated=True), instance_id)


def test_repeats_of_a_prefix_go_to_the_worker_that_caches_it(nats_server, model_dir):
    engines = {"prefill-a": _engine(model_dir), "prefill-b": _engine(model_dir)}
    layout, fmt = engines["prefill-a"].layout, engines["prefill-a"].config.kv_format
    block_bytes = kv_block_bytes(layout, fmt)
    kvpool = _start_kvpool(nats_server, block_bytes, ["--kv-layout", format_layout(layout),
                                                      "--cpu-bytes", str(64 * block_bytes)])  # fmt: skip
    prefixes = {"prefill-a": [7 + i % 50 for i in range(PREFIX_TOKENS)],
                "prefill-b": [300 + i % 70 for i in range(PREFIX_TOKENS)]}  # fmt: skip

    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        await ensure_streams(js)
        finals = await _finals(nc)
        kv = KVPoolClient(nc, transport="bus")
        async with contextlib.AsyncExitStack() as stack:
            for iid, engine in engines.items():
                await stack.enter_async_context(_worker(nats_server, engine, iid))
            # each worker computes its own prefix first: sent to it by name, as the router would
            for iid, prefix in prefixes.items():
                req = _request(f"seed-{iid}", prefix + [1, 2, 3])
                await js.publish(subjects.direct_subject("short", MODEL, iid), encode(req), headers={subjects.MSG_ID_HEADER: req.request_id})
                assert (await _final(finals, req.request_id)).worker == iid
            for iid, prefix in prefixes.items():  # their KV events reach kvpool's index
                hashes = engines[iid].reusable_prefix_hashes(prefix + [1])
                for _ in range(200):
                    hits = {h.worker: h.num_blocks for h in (await kv.lookup(hashes)).hits if h.tier == "t0"}
                    if hits.get(iid) == len(hashes):
                        break
                    await asyncio.sleep(0.05)
                assert hits == {iid: PREFIX_TOKENS // 16}
            # a burst waits before the router starts (one fetch takes it all); the router, told no
            # model names, learns them from the registry before it routes
            seen: list[str] = []

            async def on_bus(msg):
                seen.append("lookup" if msg.subject == subjects.kvpool("lookup") else "forward")

            for subject in (subjects.kvpool("lookup"), f"{subjects.PREFIX}.prefill.>"):
                await nc.subscribe(subject, cb=on_bus)
            taken: dict[str, set[str]] = {iid: set() for iid in prefixes}

            async def on_load(msg):
                load = decode(WorkerLoad, msg.data)
                taken[load.instance_id] |= set(load.taken)

            await nc.subscribe(subjects.LOADS_WILDCARD, cb=on_load)
            burst = [_request(f"kvr-burst-{i}", prefixes[iid] + [60 + i] * (3 + i))
                     for i, iid in enumerate(["prefill-a", "prefill-b"] * 3)]  # fmt: skip
            for req in burst:
                await js.publish(subjects.request_subject(MODEL), encode(req), headers={subjects.MSG_ID_HEADER: req.request_id})
            router = await stack.enter_async_context(_router(nats_server, RoutingPolicy(), 2))
            for req in burst:
                assert (await _final(finals, req.request_id)).error is None
            # side by side: every lookup was asked before any request was forwarded (one at a
            # time, each forward followed its own lookup)
            assert seen == ["lookup"] * len(burst) + ["forward"] * len(burst)
            directed, blocks = (m.values.get((MODEL,), 0) for m in (router.directed, router.directed_blocks))
            # NOTE: an order no pull pattern of the lane matches (two replicas' pulls alternate)
            for i, iid in enumerate(["prefill-a", "prefill-a", "prefill-b", "prefill-a", "prefill-b", "prefill-b"]):
                req = _request(f"repeat-{i}", prefixes[iid] + [i + 1] * (5 + i))
                await js.publish(subjects.request_subject(MODEL), encode(req), headers={subjects.MSG_ID_HEADER: req.request_id})
                final = await _final(finals, req.request_id)
                assert (final.worker, final.error, final.cached_tokens) == (iid, None, PREFIX_TOKENS)
            assert router.directed.values == {(MODEL,): directed + 6}
            assert router.directed_blocks.values == {(MODEL,): blocks + 6 * PREFIX_TOKENS // 16}
            # each worker said which requests sent to it by name it took (routers stop counting them
            # as on their way): these, and no request of its lanes
            expected = {"prefill-a": {"repeat-0", "repeat-1", "repeat-3"}, "prefill-b": {"repeat-2", "repeat-4", "repeat-5"}}
            for _ in range(100):
                if all(expected[iid] <= taken[iid] for iid in expected):
                    break
                await asyncio.sleep(0.05)
            for iid in expected:
                assert expected[iid] <= taken[iid] <= expected[iid] | {r.request_id for r in burst}
        await nc.drain()

    try:
        asyncio.run(asyncio.wait_for(body(), 180))
    finally:
        _stop(kvpool)


def test_work_left_for_a_worker_that_went_away_goes_back_to_the_lane(nats_server, model_dir):
    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        await ensure_streams(js)
        finals = await _finals(nc)
        async with _worker(nats_server, _engine(model_dir), "prefill-gone"):
            pass  # it made its direct consumer, then stopped (its registry entry is deleted)
        orphan = _request("orphan", list(range(1, 40)))
        await js.publish(subjects.direct_subject("short", MODEL, "prefill-gone"), encode(orphan), headers={subjects.MSG_ID_HEADER: "orphan"})
        async with _worker(nats_server, _engine(model_dir), "prefill-live"):
            async with _router(nats_server, RoutingPolicy(models=(MODEL,)), 1) as router:
                final = await _final(finals, "orphan")
                assert (final.worker, final.error, final.completion_tokens) == ("prefill-live", None, 3)
                for _ in range(100):
                    if router.rescued.values[()] >= 1:
                        break
                    await asyncio.sleep(0.05)
                assert router.rescued.values == {(): 1}
                # and the gone worker's consumer with it: NOTE: the router counts the move before it
                # deletes the consumer (or, the ack still pending, at its next sweep), so wait for it
                for _ in range(200):
                    try:
                        await js.consumer_info(subjects.PREFILL_STREAMS["short"],
                                               subjects.direct_consumer("prefill-gone"))
                    except NotFoundError:
                        break
                    await asyncio.sleep(0.05)
                with pytest.raises(NotFoundError):
                    await js.consumer_info(subjects.PREFILL_STREAMS["short"], subjects.direct_consumer("prefill-gone"))
        await nc.drain()

    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_request_forwarded_twice_is_stored_once_whatever_the_targets(nats_server):
    """A request that comes back to a router (its ack lost after the forward was stored) may be
    sent elsewhere the second time: its lane, a worker's direct subject and the decode pool's whole
    subject share the lane's stream, whose request-id dedup drops the second."""

    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        await ensure_streams(js)
        req = encode(_request("twice", [1, 2, 3]))
        for lane in ("short", "long"):
            first = await js.publish(subjects.direct_subject(lane, MODEL, "prefill-x"), req,
                                     headers={subjects.MSG_ID_HEADER: f"twice-{lane}"})  # fmt: skip
            assert not first.duplicate and first.stream == subjects.PREFILL_STREAMS[lane]
            for subject in (subjects.prefill_subject(lane, MODEL), subjects.whole_subject(lane, MODEL)):
                again = await js.publish(subject, req, headers={subjects.MSG_ID_HEADER: f"twice-{lane}"})
                assert again.duplicate and again.stream == first.stream
        await nc.drain()

    asyncio.run(asyncio.wait_for(body(), 30))
