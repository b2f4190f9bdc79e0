"""The router service in-process against a real nats-server: lanes, unknown models, bad payloads."""

from __future__ import annotations

import asyncio
import time

import msgpack

from llmbus.bus import subjects
from llmbus.bus.connection import connect
from llmbus.bus.service import ServiceOptions, run_service
from llmbus.bus.streams import ensure_prefill_consumer, ensure_registry, ensure_streams, ensure_urgent_consumer
from llmbus.bus.worker import PullWorker
from llmbus.protocol import GenerateRequest, InstanceInfo, TokenEvent, decode, encode
from services.router.policy import RoutingPolicy
from services.router.service import Router


async def _with_router(url: str, models: tuple[str, ...], threshold: int, scenario) -> Router:
    holder: dict = {}

    async def body(ctx):
        holder["router"] = Router(ctx, RoutingPolicy(models=models, long_threshold=threshold))
        await holder["router"].run()

    task = asyncio.create_task(run_service(ServiceOptions("router", url, models=models), body))
    while "router" not in holder or not holder["router"].ctx.is_ready:
        assert not task.done(), task.result()
        await asyncio.sleep(0.02)
    try:
        await scenario()
    finally:
        holder["router"].ctx.stop.set()
        assert await asyncio.wait_for(task, 20) == 0
    return holder["router"]


async def _collect_token_events(nc) -> dict[str, list[TokenEvent]]:
    """Every TokenEvent on llmbus.tok.*, by request id, as it arrives."""
    events: dict[str, list[TokenEvent]] = {}

    async def on_token(msg):
        ev = decode(TokenEvent, msg.data)
        events.setdefault(ev.request_id, []).append(ev)

    await nc.subscribe(subjects.TOKENS_WILDCARD, cb=on_token)
    return events


def test_router_forwards_by_lane_and_fails_unknown_models(nats_server):
    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        events = await _collect_token_events(nc)

        async def scenario():
            def req(rid, model, n, **kw):
                return GenerateRequest(rid, model, list(range(1, n + 1)), token_subject=subjects.tokens(rid), **kw)

            reqs = [req("r-short", "rt", 4), req("r-long", "rt", 5), req("r-unknown", "nope", 2),
                    req("r-late", "rt", 2, deadline=time.time() - 1)]
            for r in reqs:
                await js.publish(subjects.request_subject(r.model), encode(r), headers={subjects.MSG_ID_HEADER: r.request_id})
            garbage = msgpack.packb({"request_id": "r-bad", "model": 7})
            await js.publish(subjects.request_subject("rt"), garbage, headers={subjects.MSG_ID_HEADER: "r-bad"})

            got = {}
            for lane in ("short", "long"):
                name = await ensure_prefill_consumer(js, lane, "rt")
                w = await PullWorker.bind(js, subjects.PREFILL_STREAMS[lane], name, max_deliver=5)
                msgs = await w.fetch(10, timeout=5.0)
                got[lane] = [decode(GenerateRequest, m.data) for m in msgs]
                for m in msgs:
                    await m.ack()
                await w.close()
            assert [(r.request_id, r.lane) for r in got["short"]] == [("r-short", "short")]
            assert [(r.request_id, r.lane) for r in got["long"]] == [("r-long", "long")]
            assert got["short"][0].prompt_token_ids == [1, 2, 3, 4]
            for _ in range(100):
                if len(events) == 3:
                    break
                await asyncio.sleep(0.05)
            assert set(events) == {"r-unknown", "r-late", "r-bad"}
            unknown = events["r-unknown"][0]
            assert unknown.finish_reason == "error" and "unknown model 'nope'" in unknown.error
            assert unknown.seq == 0 and unknown.prompt_tokens == 2
            assert "deadline" in events["r-late"][0].error
            assert "malformed request" in events["r-bad"][0].error and "model" in events["r-bad"][0].error
            # the request's own fault is invalid_request, as a worker's refusals are; a lapsed deadline is not
            assert [events[r][0].error_code for r in ("r-unknown", "r-bad", "r-late")] == [
                "invalid_request", "invalid_request", ""]

        router = await _with_router(nats_server, ("rt",), 4, scenario)
        assert router.routed == 2 and router.failed == 3
        # a client's made-up model name mints no metric series of its own
        assert {model for model, _, _ in router.requests.values} == {"rt", "unknown"}
        assert (await js.stream_info(subjects.REQUESTS_STREAM)).state.messages == 0  # all acked or termed
        await nc.close()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_an_urgent_request_goes_to_its_lanes_urgent_queue(nats_server):
    """priority below 0: the lane's urgent queue; 0 and above: the shared one."""
    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()

        async def scenario():
            reqs = [GenerateRequest(rid, "pr", list(range(1, n + 1)), token_subject=subjects.tokens(rid), priority=p)
                    for rid, n, p in (("u-short", 3, -1), ("u-long", 9, -7), ("n-short", 3, 0), ("b-short", 3, 4))]
            for r in reqs:
                await js.publish(subjects.request_subject(r.model), encode(r), headers={subjects.MSG_ID_HEADER: r.request_id})
            while (await js.stream_info(subjects.REQUESTS_STREAM)).state.messages:  # all routed (side by side)
                await asyncio.sleep(0.02)
            got = {}
            for lane in ("short", "long"):
                for stream_urgent in (False, True):
                    name = await (ensure_urgent_consumer(js, lane, "pr") if stream_urgent
                                  else ensure_prefill_consumer(js, lane, "pr"))  # fmt: skip
                    w = await PullWorker.bind(js, subjects.PREFILL_STREAMS[lane], name, max_deliver=5)
                    msgs = await w.fetch(10, timeout=2.0)
                    got[lane, stream_urgent] = sorted((m.subject, decode(GenerateRequest, m.data).priority) for m in msgs)
                    for m in msgs:
                        await m.ack()
                    await w.close()
            assert got == {("short", False): [("llmbus.prefill.short.pr", 0), ("llmbus.prefill.short.pr", 4)],
                           ("short", True): [("llmbus.prefill.short.pr.urgent", -1)],
                           ("long", False): [], ("long", True): [("llmbus.prefill.long.pr.urgent", -7)]}

        router = await _with_router(nats_server, ("pr",), 4, scenario)
        assert router.routed == 4
        await nc.close()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_router_whose_first_registry_read_fails_reads_again_before_routing(nats_server, monkeypatch):
    """A request waiting when the router starts, for a model it knows only from the registry (no
    --models): a failed first read (NATS settling) must not route it knowing no worker."""
    import services.router.service as router_service

    real, failures = router_service.read_registry, []

    async def flaky(kv, *args, **kwargs):
        if not failures:
            failures.append(1)
            raise TimeoutError("the registry did not answer")
        return await real(kv, *args, **kwargs)

    monkeypatch.setattr(router_service, "read_registry", flaky)

    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        events = await _collect_token_events(nc)
        await ensure_streams(js)
        registry = await ensure_registry(js)
        await registry.put(subjects.registry_key("prefill", "pf-late"),
                           encode(InstanceInfo("pf-late", "prefill", models=["late-model"], host="h", updated_at=time.time())))
        req = GenerateRequest("r-registry-late", "late-model", [1, 2, 3], token_subject=subjects.tokens("r-registry-late"))
        await js.publish(subjects.request_subject(req.model), encode(req), headers={subjects.MSG_ID_HEADER: req.request_id})

        async def scenario():
            name = await ensure_prefill_consumer(js, "short", "late-model")
            w = await PullWorker.bind(js, subjects.PREFILL_STREAMS["short"], name, max_deliver=5)
            msgs = await w.fetch(1, timeout=5.0)
            assert [decode(GenerateRequest, m.data).request_id for m in msgs] == ["r-registry-late"]
            await msgs[0].ack()
            await w.close()

        await _with_router(nats_server, (), 4, scenario)
        assert failures and "r-registry-late" not in events
        await registry.delete(subjects.registry_key("prefill", "pf-late"))
        await nc.close()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_bad_token_subject_fails_its_request_not_the_router(nats_server):
    """A token_subject that is no literal NATS subject (whitespace, a wildcard, an empty token), or
    one of llmbus's own subjects that is no token subject, makes the request malformed: its failure goes to llmbus.tok.<request_id>, and the router
    goes on routing. So it does after a request whose error would quote megabytes."""
    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        events = await _collect_token_events(nc)

        async def scenario():
            good = GenerateRequest("r-good", "rt", [1, 2], token_subject=subjects.tokens("r-good"))
            bad = {"x-space": "llmbus.tok.a b", "x-wild": "llmbus.tok.*", "x-empty": "llmbus..tok",
                   "x-tail": "llmbus.>", "x-deputy": "llmbus.abort.r-good"}
            for rid, subject in bad.items():
                raw = msgpack.packb({"request_id": rid, "model": "rt", "prompt_token_ids": [1, 2],
                                     "token_subject": subject})
                await js.publish(subjects.request_subject("rt"), raw, headers={subjects.MSG_ID_HEADER: rid})
            # unreadable for another reason, and with a subject nats-py itself refuses
            raw = msgpack.packb({"request_id": "x-both", "model": 7, "token_subject": "a\r\nPUB x 1"})
            await js.publish(subjects.request_subject("rt"), raw, headers={subjects.MSG_ID_HEADER: "x-both"})
            # a field whose repr is four times the size of the stream's largest message: the error quoting it is cut
            raw = msgpack.packb({"request_id": "x-huge", "model": "rt", "prompt_token_ids": [1],
                                 "lane": "\x00" * (1024 * 1024 - 300)})
            await js.publish(subjects.request_subject("rt"), raw, headers={subjects.MSG_ID_HEADER: "x-huge"})
            await js.publish(subjects.request_subject("rt"), encode(good), headers={subjects.MSG_ID_HEADER: "r-good"})
            name = await ensure_prefill_consumer(js, "short", "rt")
            w = await PullWorker.bind(js, subjects.PREFILL_STREAMS["short"], name, max_deliver=5)
            msgs = await w.fetch(10, timeout=5.0)
            assert [decode(GenerateRequest, m.data).request_id for m in msgs] == ["r-good"]
            for m in msgs:
                await m.ack()
            await w.close()
            for _ in range(100):
                if len(events) == 7:
                    break
                await asyncio.sleep(0.05)
            assert set(events) == {*bad, "x-both", "x-huge"}
            for rid in bad:
                assert "malformed request" in events[rid][0].error and "token_subject" in events[rid][0].error
            huge = events["x-huge"][0].error
            assert huge.startswith("malformed request: GenerateRequest: lane must be") and len(huge) < 1100

        router = await _with_router(nats_server, ("rt",), 4, scenario)
        assert router.routed == 1 and router.failed == 7
        await nc.close()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_request_that_comes_back_after_it_was_routed_is_not_failed(nats_server):
    """A message whose ack was lost comes back after ack_wait: by then its deadline may have passed,
    but prefill is serving it. The router acks it quietly instead of sending an error event."""
    async def body():
        nc = await connect(nats_server)
        js = nc.jetstream()
        events = await _collect_token_events(nc)

        async def scenario():
            req = GenerateRequest("r-again", "rt", [1, 2], token_subject=subjects.tokens("r-again"),
                                  deadline=time.time() + 1.0)
            await js.publish(subjects.request_subject("rt"), encode(req), headers={subjects.MSG_ID_HEADER: "first"})
            name = await ensure_prefill_consumer(js, "short", "rt")
            w = await PullWorker.bind(js, subjects.PREFILL_STREAMS["short"], name, max_deliver=5)
            (forwarded,) = await w.fetch(10, timeout=5.0)
            await forwarded.ack()
            await asyncio.sleep(max(0.0, req.deadline - time.time()) + 0.1)
            # the same request again, as a redelivery brings it (another message id: the stream keeps it)
            await js.publish(subjects.request_subject("rt"), encode(req), headers={subjects.MSG_ID_HEADER: "again"})
            for _ in range(100):
                if (await js.stream_info(subjects.REQUESTS_STREAM)).state.messages == 0:
                    break
                await asyncio.sleep(0.02)
            assert await w.fetch(10, timeout=0.5) == []
            await w.close()
            await asyncio.sleep(0.2)
            assert events == {}

        router = await _with_router(nats_server, ("rt",), 4, scenario)
        assert router.routed == 1 and router.failed == 0
        await nc.close()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_router_process_reports_ready_registers_and_exits_cleanly(nats_server):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from llmbus.bus.service import READY_PREFIX
    from llmbus.bus.streams import ensure_registry
    from llmbus.protocol import InstanceInfo

    proc = subprocess.Popen([sys.executable, "-m", "services.router", "--nats-url", nats_server, "--models", "p1",
                             "--instance-id", "router-proc", "--log-level", "WARNING"],
                            cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == f"{READY_PREFIX} router router-proc"

        async def registered():
            nc = await connect(nats_server)
            kv = await ensure_registry(nc.jetstream())
            info = decode(InstanceInfo, (await kv.get("router.router-proc")).value)
            await nc.close()
            return info

        info = asyncio.run(registered())
        assert (info.role, info.models, info.pid) == ("router", ["p1"], proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    proc.stdout.close()


def test_router_cli_rejects_bad_arguments_clearly():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "services.router", "--long-threshold", "0"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "long_threshold must be >= 1" in out.stderr
