"""Token batches (``llmbus.toks.<gateway>``): one TokenEvents message per publisher turn for all of a
gateway's requests, against a real nats-server and the real colocated worker and GatewayBus."""

from __future__ import annotations

import asyncio

import msgpack

from llmbus.bus import subjects
from llmbus.bus.connection import connect
from llmbus.bus.streams import ensure_streams
from llmbus.bus.tokens import MAX_BATCH_EVENTS, TokenPublisher, read_batch
from llmbus.protocol import ProtocolError, TokenEvent, TokenEvents, decode, encode
from services.gateway.bus_client import GatewayBus
from services.gateway.token_stream import StreamFailure, TokenStream
from tests.test_prefill_worker import _colocated_worker, _engine, _submit


def _ev(rid: str, seq: int, finish: str | None = None) -> TokenEvent:
    return TokenEvent(rid, seq, [seq + 10], finish_reason=finish, completion_tokens=seq + 1)


def test_publisher_batches_one_turn_per_subject_and_keeps_order(nats_server):
    batch = subjects.token_batches("gw-a")

    async def body():
        nc = await connect(nats_server)
        got: list[tuple[str, bytes]] = []

        async def on_msg(msg):
            got.append((msg.subject, msg.data))

        await nc.subscribe(batch, cb=on_msg)
        await nc.subscribe(subjects.tokens("solo"), cb=on_msg)
        pub = TokenPublisher(nc)
        for seq in range(3):  # one turn: two requests' events and one on a request's own subject
            await pub.publish(batch, _ev("r1", seq))
            await pub.publish(batch, _ev("r2", seq))
        await pub.publish(subjects.tokens("solo"), _ev("solo", 0, "stop"))
        await asyncio.sleep(0)  # the turn ends: the batch leaves
        await pub.publish(batch, _ev("r1", 3, "length"))
        for i in range(MAX_BATCH_EVENTS + 5):
            await pub.publish(batch, _ev("big", i))
        await pub.drain()
        await nc.flush()
        await asyncio.sleep(0.2)
        await nc.close()
        return got

    got = asyncio.run(body())
    solo = [decode(TokenEvent, d) for s, d in got if s == subjects.tokens("solo")]
    assert [(e.request_id, e.finish_reason) for e in solo] == [("solo", "stop")]
    batches = [decode(TokenEvents, d).events for s, d in got if s == batch]
    assert [len(b) for b in batches] == [6, MAX_BATCH_EVENTS, 6]  # 262 events in one turn: capped per message
    assert [(e.request_id, e.seq) for e in batches[0]] == [(r, s) for s in range(3) for r in ("r1", "r2")]
    assert (batches[1][0].request_id, batches[1][0].seq, batches[1][0].finish_reason) == ("r1", 3, "length")
    assert [e.seq for b in batches[1:] for e in b if e.request_id == "big"] == list(range(MAX_BATCH_EVENTS + 5))


def test_an_event_too_big_for_the_server_loses_only_its_own_request(nats_server):
    """A batch the server refuses (one event in it over max_payload: a long prompt's logprobs) goes
    out again event by event, so the other requests' events still arrive."""
    from llmbus.protocol import LogprobEntry

    batch = subjects.token_batches("gw-big")

    async def body():
        nc = await connect(nats_server)
        got: list[TokenEvent] = []

        async def on_msg(msg):
            got.extend(decode(TokenEvents, msg.data).events)

        await nc.subscribe(batch, cb=on_msg)
        pub = TokenPublisher(nc)
        huge = [LogprobEntry(7, -1.0, [(7, -1.0)] * 20)] * (nc.max_payload // 200)
        await pub.publish(batch, _ev("a", 0))
        await pub.publish(batch, TokenEvent("b", 0, [1], prompt_logprobs=huge))
        await pub.publish(batch, _ev("c", 0))
        await pub.drain()
        await nc.flush()
        await asyncio.sleep(0.2)
        await nc.close()
        return got

    assert [(e.request_id, e.seq) for e in asyncio.run(body())] == [("a", 0), ("c", 0)]


def test_read_batch_fails_only_the_bad_event():
    good = encode(_ev("ok", 0))
    bad = {"request_id": "broken", "seq": -1}
    payload = msgpack.packb({"events": [msgpack.unpackb(good), bad, {"seq": 0}]})
    (r1, e1), (r2, e2), (r3, e3) = read_batch(payload)
    assert r1 == "ok" and isinstance(e1, TokenEvent) and e1.token_ids == [10]
    assert r2 == "broken" and isinstance(e2, ProtocolError) and "seq" in str(e2)
    assert r3 is None and isinstance(e3, ProtocolError)
    [(rid, err)] = read_batch(b"\xc1 not msgpack")
    assert rid is None and isinstance(err, ProtocolError)


def test_gateway_routes_batched_events_to_their_streams(nats_server):
    async def body():
        nc = await connect(nats_server)
        bus = GatewayBus(nc, "gw-route")
        await bus.start()
        a, b = TokenStream("ra", 2.0), TokenStream("rb", 2.0)
        bus._streams.update({"ra": a, "rb": b})  # as submit registers them
        bad = {"request_id": "rb", "seq": 0, "finish_reason": "exploded"}
        events = [msgpack.unpackb(encode(_ev("ra", 0))), bad, msgpack.unpackb(encode(_ev("gone", 0))),
                  msgpack.unpackb(encode(_ev("ra", 1, "stop")))]  # fmt: skip
        await nc.publish(bus.token_subject, msgpack.packb({"events": events}))
        got = [await a.next(), await a.next()]
        try:
            await b.next()
            failure = None
        except StreamFailure as exc:
            failure = exc
        await nc.close()
        return got, failure

    got, failure = asyncio.run(body())
    assert [(e.seq, e.finish_reason) for e in got] == [(0, None), (1, "stop")]
    assert failure is not None and failure.code == "bad_event" and "finish_reason" in str(failure)


def test_colocated_worker_sends_a_step_of_several_requests_as_one_message(nats_server, tmp_path):
    model = "batched"
    engine = _engine(tmp_path, enable_prefix_caching=False)
    subject = subjects.token_batches("gw-batch")
    n_requests, max_tokens = 4, 6

    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        await ensure_streams(js)
        messages: list[list[TokenEvent]] = []
        done = asyncio.Event()

        async def on_batch(msg):
            messages.append(decode(TokenEvents, msg.data).events)
            if sum(1 for m in messages for e in m if e.finish_reason) == n_requests:
                done.set()

        await nc.subscribe(subject, cb=on_batch)
        for i in range(n_requests):
            await _submit(js, model, f"b-{i}", list(range(5 + i, 35 + i)), max_tokens, token_subject=subject)
        async with _colocated_worker(nats_server, engine, model):
            await asyncio.wait_for(done.wait(), 60)
        await nc.close()
        return messages

    messages = asyncio.run(body())
    events = [e for m in messages for e in m]
    assert len(events) == n_requests * max_tokens
    for i in range(n_requests):
        mine = [e for e in events if e.request_id == f"b-{i}"]
        assert [e.seq for e in mine] == list(range(max_tokens)) and mine[-1].finish_reason == "length"
    # the requests decode in the same steps: their events share messages (a message may also carry
    # two steps' events when the publisher had both before it yielded)
    assert len(messages) < len(events) // 2 and max(len(m) for m in messages) >= n_requests
