"""TokenStream ordering rules, and the gateway's bus client refusing cleanly when no stream exists."""

import asyncio

import pytest

from llmbus.bus.connection import connect
from llmbus.bus.server import EmbeddedNats
from llmbus.protocol import GenerateRequest, TokenEvent, encode
from services.gateway.bus_client import GatewayBus
from services.gateway.errors import APIError
from services.gateway.token_stream import StreamFailure, TokenStream


def _ev(seq, rid="r1", ids=(1,)):
    return encode(TokenEvent(rid, seq, list(ids)))


def _run(coro):
    return asyncio.run(coro)


def test_in_order_and_duplicates_skipped():
    async def go():
        s = TokenStream("r1", 5.0)
        for seq in (0, 0, 1, 1, 2):
            s.push(_ev(seq, ids=(seq,)))
        return [(await s.next()).seq for _ in range(3)]

    assert _run(go()) == [0, 1, 2]


@pytest.mark.parametrize("payloads,code", [
    ([_ev(0), _ev(2)], "gap"),
    ([b"\xc1not msgpack"], "bad_event"),
    ([encode(GenerateRequest("r1", "m", [1]))], "bad_event"),
    ([_ev(0, rid="other")], "bad_event"),
    ([_ev(0)], "timeout"),
])
def test_failures(payloads, code):
    async def go():
        s = TokenStream("r1", 0.2)
        for p in payloads:
            s.push(p)
        while True:
            await s.next()

    with pytest.raises(StreamFailure) as exc:
        _run(go())
    assert exc.value.code == code


def test_silence_timeout_must_be_positive():
    with pytest.raises(ValueError, match="silence_timeout_s"):
        TokenStream("r1", 0)


def test_submit_without_request_stream_is_503(tmp_path):
    async def go(url):
        nc = await connect(url)
        try:
            bus = GatewayBus(nc, "gw-test", publish_timeout_s=2.0)
            req = GenerateRequest("cmpl-x", "demo", [1, 2], token_subject="llmbus.tok.cmpl-x")
            with pytest.raises(APIError) as exc:
                await bus.submit(req, TokenStream("cmpl-x", 1.0))
            assert (exc.value.status, exc.value.code) == (503, "service_unavailable")
            assert "cmpl-x" not in bus._streams  # its route dropped again
        finally:
            await nc.close()

    with EmbeddedNats(tmp_path / "nats") as server:
        _run(go(server.url))


def test_a_submit_that_times_out_is_aborted_in_case_it_was_stored(tmp_path):
    """A publish whose ack never came may have been stored all the same: the client gets its 503,
    and the workers an Abort, or the request would be generated for nobody."""
    from llmbus.bus import subjects
    from llmbus.protocol import Abort, decode

    async def go(url):
        nc = await connect(url)
        try:
            taken, aborts = [], []

            async def silent(msg):  # takes the request and never acks it: the publish times out
                taken.append(msg.data)

            async def on_abort(msg):
                aborts.append(decode(Abort, msg.data))

            await nc.subscribe(subjects.request_subject("demo"), cb=silent)
            await nc.subscribe(subjects.abort("cmpl-y"), cb=on_abort)
            bus = GatewayBus(nc, "gw-test", publish_timeout_s=0.3)
            req = GenerateRequest("cmpl-y", "demo", [1, 2])
            with pytest.raises(APIError) as exc:
                await bus.submit(req, TokenStream("cmpl-y", 1.0))
            assert (exc.value.status, exc.value.code) == (503, "service_unavailable")
            await nc.flush()
            for _ in range(50):
                if aborts:
                    break
                await asyncio.sleep(0.02)
            assert len(taken) == 1 and aborts == [Abort("cmpl-y", "submit_failed")]
        finally:
            await nc.close()

    with EmbeddedNats(tmp_path / "nats") as server:
        _run(go(server.url))


@pytest.mark.parametrize("how", ["refused", "cancelled"])
def test_choices_are_enqueued_all_or_none(tmp_path, how):
    """A request's choices go out together; when one cannot be enqueued (its publish gets no ack),
    or the handler is cancelled meanwhile (the client left), none is left behind: every route is
    dropped and every choice aborted."""
    import json

    from llmbus.bus import subjects
    from llmbus.protocol import Abort, decode
    from services.gateway.handlers import _submit_all, choice_requests

    async def go(url):
        nc = await connect(url)
        try:
            aborts = []

            async def stream(msg):  # plays JetStream: acks every choice but "-1" ("cancelled": none)
                rid = msg.headers[subjects.MSG_ID_HEADER]
                if how == "refused" and not rid.endswith("-1"):
                    await msg.respond(json.dumps({"stream": "REQUESTS", "seq": 1}).encode())

            async def on_abort(msg):
                aborts.append(decode(Abort, msg.data))

            await nc.subscribe(subjects.request_subject("demo"), cb=stream)
            await nc.subscribe(subjects.ABORTS_WILDCARD, cb=on_abort)
            bus = GatewayBus(nc, "gw-test", publish_timeout_s=0.5)
            requests = choice_requests([GenerateRequest("cmpl-z", "demo", [1, 2])], 3)
            submit = asyncio.ensure_future(_submit_all(bus, requests, [TokenStream(r.request_id, 1.0) for r in requests]))
            if how == "refused":
                with pytest.raises(APIError) as exc:
                    await submit
                assert exc.value.status == 503
            else:
                await asyncio.sleep(0.1)
                submit.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await submit
            await nc.flush()
            for _ in range(100):
                if {a.request_id for a in aborts} == {r.request_id for r in requests}:
                    break
                await asyncio.sleep(0.02)
            assert {a.request_id for a in aborts} == {"cmpl-z-0", "cmpl-z-1", "cmpl-z-2"}
            assert bus._streams == {}
        finally:
            await nc.close()

    with EmbeddedNats(tmp_path / "nats") as server:
        _run(go(server.url))


def test_gateway_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, services.gateway.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_handed_on_request_waits_for_its_next_worker_not_its_last():
    """A worker that stops hands the request on and repeats its last seq from no worker: the
    stream then asks whether the model's workers are busy, not whether the stopped one lives."""

    async def go():
        gone = {"worker-a"}

        async def busy(last_worker: str) -> bool:
            return last_worker not in gone  # (the registry: worker-a left, others are busy)

        s = TokenStream("r1", 0.05, busy=busy)
        for seq in (0, 1):
            s.push(encode(TokenEvent("r1", seq, [seq], worker="worker-a")))
        s.push(encode(TokenEvent("r1", 1, [], worker="")))  # the hand-on notice
        got = [(await s.next()).seq for _ in range(2)]
        asyncio.get_running_loop().call_later(0.3, s.push, encode(TokenEvent("r1", 2, [2], worker="worker-b")))
        got.append((await s.next()).seq)  # several silence timeouts later
        return got, s.last_worker

    assert _run(go()) == ([0, 1, 2], "worker-b")
