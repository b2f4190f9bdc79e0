"""A step that raises fails only the requests it fails on alone: the engine runs it again in halves,
ends those with "error" (their blocks freed) and the rest go on exactly as if the failing request
had never come. An engine that fails on everything it runs still raises (its worker exits).

The failures are injected into the real engine's forward pass and sampler (a poison token in a
prompt; a request's nth sampled token), the only way to make a working model fail on demand."""

from __future__ import annotations

import asyncio

import pytest

from llmbus.bus import subjects
from llmbus.engine.llm import LLM
from llmbus.engine.sampling_params import SamplingParams
from llmbus.protocol import encode
from tests.test_decode_worker import _bus, _decode_worker, _final_event, _handed_off, _handoff_in_pool, with_kvpool
from tests.test_engine import model_dir, prompts  # noqa: F401 - fixtures
from tests.test_prefill_worker import _colocated_worker, _engine, _handing_off_bus, _submit, _token_events

POISON = 2  # a token id no fixture prompt holds (they draw from 3 up)


class _AnyError(str):
    def __eq__(self, other) -> bool:
        return "broke the forward pass" in other

    __hash__ = str.__hash__


ANY_ERROR = _AnyError()
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def poison_forward(engine, token: int = POISON) -> None:
    """The engine's forward pass raises on any batch holding ``token``."""
    forward = engine.runner._forward

    def forward_or_raise(batch):
        if (batch.ids == token).any():
            raise RuntimeError(f"token {token} broke the forward pass")
        return forward(batch)

    engine.runner._forward = forward_or_raise


def poison_sampling(engine, request_id: str, after: int) -> None:
    """The sampler raises on any batch holding ``request_id`` once it has ``after`` output tokens."""
    sampler = engine.runner.sampler

    class Failing:
        def __getattr__(self, name):
            return getattr(sampler, name)

        def __call__(self, logits, seqs, ahead=None):
            if any(s.request_id == request_id and len(s.output_token_ids) >= after for s in seqs):
                raise ValueError(f"sampling {request_id} failed")
            return sampler(logits, seqs, ahead)

    engine.runner.sampler = Failing()


def run(engine, requests: dict[str, list[int]]) -> dict:
    """Every request to its end: request id -> (tokens, finish reason, error)."""
    for rid, prompt in requests.items():
        engine.add_request(rid, prompt, GREEDY)
    tokens = {rid: [] for rid in requests}
    ends = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                ends[out.request_id] = (out.finish_reason, out.error)
    return {rid: (tokens[rid], *ends[rid]) for rid in requests}


def assert_clean(engine) -> None:
    check = engine.leak_check()
    assert check["requests"] == 0 and check["free_blocks"] == check["total_blocks"] and check["tail_rows"] == 0


CONFIGS = {
    "model": dict(),
    "two-microbatches": dict(num_threads=2, cpu_micro_batches=2),
    "chunked": dict(max_num_batched_tokens=16),
    # int4 keeps exact tail rows, and a chunk that seals one block and starts the next switches a
    # sequence's two rows as the step is prepared: a step run again must not switch them back
    "int4-chunked": dict(kv_format="int4", max_num_batched_tokens=16),
}
EXACT = {name: CONFIGS[name] for name in ("model", "two-microbatches", "chunked")}


@pytest.mark.parametrize("config", EXACT.values(), ids=EXACT.keys())
def test_a_request_that_breaks_the_forward_pass_fails_alone(model_dir, prompts, config):  # noqa: F811
    requests = {f"ok-{i}": p for i, p in enumerate(prompts)}
    clean = run(LLM(model_dir, dtype="float32", device="cpu", **config).engine, requests)
    engine = LLM(model_dir, dtype="float32", device="cpu", **config).engine
    poison_forward(engine)
    poison = ("poison", prompts[3][:5] + [POISON] + prompts[3][5:])
    got = run(engine, dict([*list(requests.items())[:3], poison, *list(requests.items())[3:]]))
    tokens, reason, error = got.pop("poison")
    assert (tokens, reason) == ([], "error")
    assert "RuntimeError: token 2 broke the forward pass" in error
    assert got == clean  # the others, token for token, as if it had never come
    assert all(reason == "length" for _, reason, _ in clean.values())
    assert engine.stats.finished.values[("error",)] == 1
    assert_clean(engine)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_step_that_fails_once_and_runs_in_halves_computes_the_same(model_dir, prompts, config):  # noqa: F811
    """A failure that does not come back (the whole batch too big for the moment, say): no request
    fails, and every token is what a run without it gives (int4's quantized cache included: the
    same chunks, sealed from the same rows)."""
    requests = {f"ok-{i}": p for i, p in enumerate(prompts)}
    clean = run(LLM(model_dir, dtype="float32", device="cpu", **config).engine, requests)
    engine = LLM(model_dir, dtype="float32", device="cpu", **config).engine
    forward, calls = engine.runner._forward, []

    def fails_once(batch):
        calls.append(batch.ids.numel())
        if len(calls) == 3:  # the third: chunked, a prompt's chunk that seals a block beside the next prompt's
            raise RuntimeError("not this time")
        return forward(batch)

    engine.runner._forward = fails_once
    assert run(engine, requests) == clean
    assert ("error",) not in engine.stats.finished.values
    assert_clean(engine)


@pytest.mark.parametrize("config", [CONFIGS["model"], CONFIGS["int4-chunked"]], ids=["model", "int4-chunked"])
def test_a_request_that_fails_mid_decode_keeps_its_tokens_and_frees_its_blocks(model_dir, prompts, config):  # noqa: F811
    requests = {f"ok-{i}": p for i, p in enumerate(prompts)}
    clean = run(LLM(model_dir, dtype="float32", device="cpu", **config).engine, requests)
    engine = LLM(model_dir, dtype="float32", device="cpu", **config).engine
    poison_sampling(engine, "ok-2", after=5)
    got = run(engine, requests)
    tokens, reason, error = got.pop("ok-2")
    assert tokens == clean.pop("ok-2")[0][:5] and reason == "error"
    assert "ValueError: sampling ok-2 failed" in error
    assert got == clean
    assert_clean(engine)


def test_an_engine_that_fails_on_everything_raises_and_ends_nobody(model_dir, prompts):  # noqa: F811
    """A dead device: the engine's own one-token step fails too, so the step raises (the worker
    exits, its jobs go to another replica) and no request is ended with an error."""
    engine = LLM(model_dir, dtype="float32", device="cpu").engine

    def broken(batch):
        raise RuntimeError("the device is gone")

    engine.runner._forward = broken
    for rids in (["alone"], ["one", "two"]):
        for rid in rids:
            engine.add_request(rid, prompts[len(rid)], GREEDY)
        with pytest.raises(RuntimeError, match="the device is gone"):
            engine.step()
        assert ("error",) not in engine.stats.finished.values
        for rid in rids:
            assert engine.abort(rid)  # still the engine's: nothing ended them
    assert_clean(engine)


def test_copies_of_one_bad_request_fail_alone_and_the_engine_goes_on(model_dir, prompts):  # noqa: F811
    """Everything a step ran failed, but the engine's own step runs: the requests' fault, not the
    engine's (n copies of one bad request, or one alone on a quiet worker)."""
    engine = LLM(model_dir, dtype="float32", device="cpu").engine
    poison_forward(engine)
    bad = [POISON] + prompts[0]
    assert run(engine, {"copy-0": bad, "copy-1": bad}) == {rid: ([], "error", ANY_ERROR) for rid in ("copy-0", "copy-1")}
    for i in range(3):  # one after another on an idle engine: never counted against it
        assert run(engine, {f"alone-{i}": bad})[f"alone-{i}"][1] == "error"
    assert run(engine, {"fine": prompts[1]})["fine"][1] == "length"
    assert_clean(engine)


def test_a_failed_micro_batch_step_waits_for_the_others_before_it_is_run_again(model_dir, prompts):  # noqa: F811
    """Split over threads, a step whose first micro-batch raises returns only once the others are
    done: run again at once, they would write the cache beside the retry."""
    import threading
    import time

    engine = LLM(model_dir, dtype="float32", device="cpu", num_threads=2, cpu_micro_batches=2).engine
    forward, order = engine.runner._forward, []

    def first_fails_once(batch):
        if threading.current_thread() is threading.main_thread():
            if not order:
                order.append("raised")
                raise RuntimeError("not this time")
        elif "other done" not in order:
            for _ in range(200):  # until the first has raised, then on for a while (still writing)
                if order:
                    break
                time.sleep(0.01)
            time.sleep(0.3)
            order.append("other done")
        return forward(batch)

    engine.runner._forward = first_fails_once
    execute = engine.runner.execute

    def execute_noting(out):
        try:
            return execute(out)
        except Exception:
            order.append("step raised")
            raise

    engine.runner.execute = execute_noting
    requests = {f"mb-{i}": p for i, p in enumerate(prompts)}
    run(engine, requests)
    assert order[:3] == ["raised", "other done", "step raised"], order


def test_the_offline_api_reports_a_failed_request(model_dir, prompts):  # noqa: F811
    llm = LLM(model_dir, dtype="float32", device="cpu")
    poison_forward(llm.engine)
    bad, good = llm.generate([[POISON] + prompts[0], prompts[1]], GREEDY)
    assert (bad.finish_reason, bad.token_ids, good.finish_reason) == ("error", [], "length")
    assert "broke the forward pass" in bad.error and good.error == ""


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "handing-off"])
def test_a_job_the_step_fails_on_ends_with_an_error_and_is_not_redelivered(nats_server, tmp_path, colocated):
    """Through a prefill worker on a real bus: the poisoned job's client gets a final "error"
    event and its message is terminated, so no other worker takes it (and fails on it, or, where
    the failure kills the engine, dies of it); the job beside it goes on (to its end, or handed
    off), and so does one after."""
    model = f"stepfails-{colocated}"
    engine = _engine(tmp_path, enable_prefix_caching=False)
    poison_forward(engine)
    tokens = 4 if colocated else 1  # handing off, prefill sends the first token and decode the rest
    # (ids unique to each case: the bus drops a job whose id it saw in the last two minutes)
    poisoned, beside, after = (f"{rid}-{model}" for rid in ("poisoned", "beside-it", "after-it"))

    async def body():
        nc, js, _ = await _handing_off_bus(nats_server, model)
        events, done = await _token_events(nc, lambda ev: ev.request_id == after and len(events[after]) == tokens)
        await _submit(js, model, beside, list(range(7, 47)), 4)
        await _submit(js, model, poisoned, list(range(7, 27)) + [POISON], 4)
        async with _colocated_worker(nats_server, engine, model, colocated=colocated) as worker:
            while poisoned not in events or len(events.get(beside, ())) < tokens:
                await asyncio.sleep(0.01)
            await _submit(js, model, after, list(range(9, 49)), 4)
            await asyncio.wait_for(done.wait(), 30)
            while worker.jobs:  # (a handoff's ack comes after its first token)
                await asyncio.sleep(0.01)
            info = await js.consumer_info(subjects.PREFILL_STREAMS["short"], subjects.prefill_consumer("short", model))
        await nc.close()
        return events, info

    events, info = with_kvpool(nats_server, engine, body)
    (failure,) = events[poisoned]
    assert failure.finish_reason == "error" and "broke the forward pass" in failure.error
    assert failure.error_code == ""  # ours, not the request's: the gateway answers 500
    for rid in (beside, after):
        assert [len(e.token_ids) for e in events[rid]] == [1] * tokens
        assert events[rid][-1].finish_reason == ("length" if colocated else None)
    assert info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0
    assert_clean(engine)


def test_a_decode_worker_ends_a_request_the_step_fails_on_with_an_error(nats_server, tmp_path):
    """Mid-decode: the client has its tokens so far, then a final "error" event; the worker holds
    nothing of it after (its blocks free, nothing stored for it)."""
    model, rid = "decodestepfails", "fails-mid-decode"
    source, engine, prompt, state, kv, first = _handed_off(tmp_path, rid)
    poison_sampling(engine, rid, after=4)

    async def body():
        nc, js, client = await _bus(nats_server)
        handoff = await _handoff_in_pool(client, engine, model, prompt, state, kv, first)
        events, done = await _final_event(nc, rid)
        async with _decode_worker(nats_server, engine, model) as worker:
            await js.publish(subjects.decode_subject(model), encode(handoff), headers={subjects.MSG_ID_HEADER: rid})
            await asyncio.wait_for(done.wait(), 30)
            assert worker.active == {} and worker.stores_in_flight == 0
        await nc.close()
        return events

    events = with_kvpool(nats_server, engine, body)
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert [len(e.token_ids) for e in events] == [1, 1, 1, 0]  # the handoff brought the first token
    assert events[-1].finish_reason == "error" and "sampling fails-mid-decode failed" in events[-1].error
    assert_clean(engine)
    source.abort(rid)


def test_llmbus_generate_says_which_prompt_failed_and_exits_1(model_dir, prompts, monkeypatch, capsys):  # noqa: F811
    import json

    from llmbus.cli import main
    from llmbus.engine.runner import ModelRunner

    forward = ModelRunner._forward

    def forward_or_raise(self, batch):
        if (batch.ids == POISON).any():
            raise RuntimeError("token 2 broke the forward pass")
        return forward(self, batch)

    monkeypatch.setattr(ModelRunner, "_forward", forward_or_raise)
    ids = [",".join(map(str, p)) for p in ([POISON] + prompts[0], prompts[1])]
    code = main(["generate", "--model", str(model_dir), "--prompt-ids", ids[0], "--prompt-ids", ids[1],
                 "--max-tokens", "4", "--ignore-eos", "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    bad, good = (json.loads(line) for line in out.splitlines())
    assert code == 1
    assert bad["finish_reason"] == "error" and "broke the forward pass" in bad["error"] and bad["token_ids"] == []
    assert good["finish_reason"] == "length" and len(good["token_ids"]) == 4 and "error" not in good
    assert "llmbus generate: prompt 1: the engine failed on this request" in err and "broke the forward pass" in err
