"""The gateway's request path against a scripted worker on the real bus: exact SSE and JSON shapes,
usage, stop strings, multi-byte characters split across tokens, gaps, silence, worker errors, and
the Abort after a client disconnect."""

import asyncio
import json
import contextlib
import time

import httpx
import openai
import pytest

from llmbus.bus import subjects
from llmbus.protocol import InstanceInfo, LogprobEntry, TokenEvent, encode
from tests.test_gateway_harness import (  # noqa: F401
    MAX_MODEL_LEN, TOKEN_TIMEOUT_S, gateway, gw_nats, http, model_dir, scratch, reply_script, sse_events, tokenizer, wait_for, worker,
)

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]


def _ids(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text  # the reference the gateway's output must equal
    return ids


def _last_request(worker, request_id):
    matches = [(r, h) for r, h in worker.requests if r.request_id == request_id]
    assert len(matches) == 1
    return matches[0]


def test_chat_non_stream_shape_usage_and_request(http, worker, tokenizer):
    ids = _ids(tokenizer, "Hello world!")
    worker.script = reply_script(ids, per_event=2, cached=16)
    r = http.post(CHAT, json={"model": "demo", "messages": MSGS, "temperature": 0.5, "top_p": 0.9, "seed": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    req, headers = _last_request(worker, body["id"])
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MSGS), add_special_tokens=False)
    assert req.prompt_token_ids == prompt
    assert headers["Nats-Msg-Id"] == req.request_id and req.request_id.startswith("chatcmpl-")
    # one subject per gateway instance: its workers send every step's events for it in one message
    assert req.token_subject.startswith("llmbus.toks.") and req.deadline > req.created
    s = req.sampling
    assert (s.temperature, s.top_p, s.seed, s.max_tokens) == (0.5, 0.9, 7, MAX_MODEL_LEN - len(prompt))
    assert body == {
        "id": req.request_id, "object": "chat.completion", "created": body["created"], "model": "demo",
        "system_fingerprint": None, "service_tier": "default",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello world!"}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                  "total_tokens": len(prompt) + len(ids), "prompt_tokens_details": {"cached_tokens": 16}},
    }
    assert worker.aborts_for(req.request_id) == []


def test_chat_stream_exact_chunks_with_usage(http, worker, tokenizer):
    text = "Hi there, friend."
    ids = _ids(tokenizer, text)
    worker.script = reply_script(ids, cached=0)
    body = {"model": "demo", "messages": MSGS, "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 20}
    with http.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    rid, created = chunks[0]["id"], chunks[0]["created"]
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": "demo",
            "system_fingerprint": None, "service_tier": "default"}
    assert chunks[0] == {**head, "usage": None, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
    contents = chunks[1:-2]
    for c in contents:
        assert c == {**head, "usage": None, "choices": [
            {"index": 0, "delta": {"content": c["choices"][0]["delta"]["content"]}, "logprobs": None,
             "finish_reason": None}]}
    assert "".join(c["choices"][0]["delta"]["content"] for c in contents) == text
    assert chunks[-2] == {**head, "usage": None, "choices": [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]}
    req, _ = _last_request(worker, rid)
    n = len(req.prompt_token_ids)
    assert req.sampling.max_tokens == 20
    assert chunks[-1] == {**head, "choices": [], "usage": {
        "prompt_tokens": n, "completion_tokens": len(ids), "total_tokens": n + len(ids),
        "prompt_tokens_details": {"cached_tokens": 0}}}


def test_openai_client_stream_and_completion(gateway, worker, tokenizer):
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    ids = _ids(tokenizer, "The quick brown fox")
    worker.script = reply_script(ids, per_event=3, finish="length")
    stream = client.chat.completions.create(model="demo", messages=MSGS, stream=True,
                                            stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert ("".join(parts), finish, usage.completion_tokens) == ("The quick brown fox", "length", len(ids))
    worker.script = reply_script(ids)
    out = client.completions.create(model="demo", prompt="Once upon", max_tokens=30)
    assert out.choices[0].text == "The quick brown fox" and out.choices[0].finish_reason == "stop"
    req, _ = _last_request(worker, out.id)
    assert req.prompt_token_ids == tokenizer.encode("Once upon") and out.id.startswith("cmpl-")
    assert out.usage.prompt_tokens == len(req.prompt_token_ids)


def test_multibyte_characters_split_across_tokens_come_out_whole(http, worker, tokenizer):
    text = "héllo 😀 wörld ñ"
    ids = _ids(tokenizer, text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some character really is split
    worker.script = reply_script(ids)
    with http.stream("POST", COMP, json={"model": "demo", "prompt": "x", "stream": True}) as r:
        events = sse_events(r)
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == text and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["object"] == "text_completion"


def test_stop_string_streamed_is_held_back_cut_and_aborts(http, worker, tokenizer):
    text = "one two STOP three four"
    ids = _ids(tokenizer, text)
    k = next(k for k in range(1, len(ids) + 1) if "STOP" in tokenizer.decode(ids[:k]))
    worker.script = reply_script(ids, delay=0.01)
    body = {"model": "demo", "prompt": "x", "stream": True, "stop": ["STOP", "never"],
            "stream_options": {"include_usage": True}}
    with http.stream("POST", COMP, json=body) as r:
        events = sse_events(r)
    texts = [e["choices"][0]["text"] for e in events[:-2]]
    assert "".join(texts) == "one two " and all("S" not in t for t in texts)
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["usage"]["completion_tokens"] == k and events[-1] == "[DONE]"
    rid = events[0]["id"]
    aborts = wait_for(lambda: worker.aborts_for(rid), what="the stop-string abort")
    assert [a.reason for a in aborts] == ["stop_string"]


def test_stop_string_non_stream(http, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "alpha\n\nbeta"))
    r = http.post(CHAT, json={"model": "demo", "messages": MSGS, "stop": "\n\n"})
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("alpha", "stop")


def test_gap_in_seq_ends_stream_with_error_event(http, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "a b c d e f"), gap_after=1)
    with http.stream("POST", CHAT, json={"model": "demo", "messages": MSGS, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == "gap" and err["type"] == "server_error" and "lost" in err["message"]
    rid = events[0]["id"]
    assert [a.reason for a in wait_for(lambda: worker.aborts_for(rid))] == ["token_stream_failed"]


def test_gap_non_stream_is_503(http, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "a b c d e f"), gap_after=0)
    r = http.post(COMP, json={"model": "demo", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "gap"


def test_silence_ends_stream_with_timeout_error(http, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "a b c d e f"), silent_after=2)
    with http.stream("POST", COMP, json={"model": "demo", "prompt": "x", "stream": True}) as r:
        events = sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == tokenizer.decode(_ids(tokenizer, "a b c d e f")[:2])
    assert events[-2]["error"]["code"] == "timeout" and events[-1] == "[DONE]"


@contextlib.contextmanager
def _busy_worker_in_registry(url: str, model: str):
    """A live prefill worker of ``model`` holding requests, as its registry heartbeat says."""
    import nats

    key = "prefill.busy-in-registry"

    async def registry(change):
        nc = await nats.connect(url)
        await change(await nc.jetstream().key_value(subjects.REGISTRY_BUCKET))
        await nc.close()

    info = InstanceInfo("busy-in-registry", "prefill", [model], free_blocks=0, queue_depth=3, updated_at=time.time())
    asyncio.run(registry(lambda kv: kv.put(key, encode(info))))
    try:
        yield
    finally:
        asyncio.run(registry(lambda kv: kv.delete(key)))


def test_silence_while_the_models_workers_are_busy_is_queueing(http, worker, gw_nats, tokenizer):
    """A request queued behind others (in a stream, or waiting for blocks) hears nothing for longer
    than --token-timeout. While the registry shows a live worker of its model holding requests, the
    gateway keeps waiting (up to the request's deadline) instead of failing it as "the workers
    stopped answering"; with no busy worker, or when the worker that sent its last event is gone
    from the registry, silence still fails."""
    ids = _ids(tokenizer, "a b c")
    script = reply_script(ids)

    async def queued(req, emit):
        await asyncio.sleep(3 * TOKEN_TIMEOUT_S)
        await script(req, emit)

    worker.script = queued
    with _busy_worker_in_registry(gw_nats, "demo"):
        r = http.post(COMP, json={"model": "demo", "prompt": "x"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == tokenizer.decode(ids)
        # the worker that sent its last event is not in the registry: it died holding it
        worker.script = reply_script(ids, silent_after=1)
        r = http.post(COMP, json={"model": "demo", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "timeout"
    worker.script = queued
    r = http.post(COMP, json={"model": "demo", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "timeout"


def test_worker_error_non_stream_500_and_stream_event(http, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "a b"), error="out of KV blocks")
    r = http.post(CHAT, json={"model": "demo", "messages": MSGS})
    err = r.json()["error"]
    assert r.status_code == 500 and err["type"] == "server_error" and "out of KV blocks" in err["message"]
    with http.stream("POST", CHAT, json={"model": "demo", "messages": MSGS, "stream": True}) as r:
        events = sse_events(r)
    assert "out of KV blocks" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    assert worker.aborts_for(events[0]["id"]) == []  # the worker ended it: nothing to abort


def test_a_request_a_worker_finds_invalid_is_a_400(http, worker, tokenizer):
    """A worker can refuse what the gateway could not check (a prompt larger than the workers'
    whole KV cache): error_code "invalid_request" makes that the client's 400, not a 500 that
    OpenAI clients retry."""
    message = "invalid request: the prompt needs 69 KV blocks but this engine has only 64"

    async def refuse(req, emit):
        await emit(TokenEvent.failure(req.request_id, message, code="invalid_request"))

    worker.script = refuse
    r = http.post(COMP, json={"model": "demo", "prompt": "x"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["message"] == message
    with http.stream("POST", COMP, json={"model": "demo", "prompt": "x", "stream": True}) as r:
        events = sse_events(r)
    assert events[-2]["error"]["message"] == message and events[-1] == "[DONE]"


def test_a_request_the_workers_end_at_its_deadline_is_a_503_saying_so(http, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "a b"), finish="abort", error="the request's deadline passed")
    r = http.post(CHAT, json={"model": "demo", "messages": MSGS})
    err = r.json()["error"]
    assert (r.status_code, err["code"]) == (503, "aborted") and "deadline passed" in err["message"]
    with http.stream("POST", CHAT, json={"model": "demo", "messages": MSGS, "stream": True}) as r:
        events = sse_events(r)
    assert events[-2]["error"]["code"] == "aborted" and "deadline passed" in events[-2]["error"]["message"]
    assert events[-1] == "[DONE]" and worker.aborts_for(events[0]["id"]) == []  # the worker ended it


def _logprob_entries(chunk):
    return [LogprobEntry(t, -0.25 * (j + 1), [(t, -0.25 * (j + 1)), (7, -3.0)]) for j, t in enumerate(chunk)]


def test_chat_logprobs(http, worker, tokenizer):
    ids = _ids(tokenizer, "Hello world")
    worker.script = reply_script(ids, per_event=len(ids), logprobs=_logprob_entries)
    r = http.post(CHAT, json={"model": "demo", "messages": MSGS, "logprobs": True, "top_logprobs": 2})
    req, _ = _last_request(worker, r.json()["id"])
    assert req.sampling.logprobs == 2
    content = r.json()["choices"][0]["logprobs"]["content"]
    want = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert [c["token"] for c in content] == want
    assert [c["logprob"] for c in content] == [-0.25 * (j + 1) for j in range(len(ids))]
    assert content[0]["bytes"] == list(want[0].encode()) and content[0]["top_logprobs"][1]["logprob"] == -3.0


def test_completion_logprobs_and_token_prompt(http, worker, tokenizer):
    ids = _ids(tokenizer, "ab cd")
    worker.script = reply_script(ids, per_event=len(ids), logprobs=_logprob_entries)
    body = {"model": "demo", "prompt": [5, 6, 7], "logprobs": 1, "max_tokens": 9, "top_k": 5, "min_p": 0.1,
            "repetition_penalty": 1.1, "ignore_eos": True, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "stop_token_ids": [3]}
    r = http.post(COMP, json=body).json()
    req, _ = _last_request(worker, r["id"])
    s = req.sampling
    assert req.prompt_token_ids == [5, 6, 7]
    assert (s.max_tokens, s.top_k, s.min_p, s.repetition_penalty, s.ignore_eos, s.presence_penalty,
            s.frequency_penalty, s.stop_token_ids, s.logprobs) == (9, 5, 0.1, 1.1, True, 0.5, -0.5, [3], 1)
    lp = r["choices"][0]["logprobs"]
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["tokens"] == tokens
    assert lp["text_offset"] == [sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]
    assert lp["top_logprobs"][0] == {tokens[0]: -0.25, tokenizer.decode([7], skip_special_tokens=False): -3.0}


def _streamed_logprobs(http, path, body):
    """(text, logprob entries) of a streamed response, the entries of every chunk in order."""
    with http.stream("POST", path, json=body | {"stream": True}) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    choices = [e["choices"][0] for e in events if e["choices"]]
    text = "".join(c["delta"].get("content") or "" if "delta" in c else c["text"] for c in choices)
    entries = [x for c in choices if c["logprobs"] for x in (c["logprobs"]["content"] if "delta" in c else
                                                           zip(c["logprobs"]["tokens"], c["logprobs"]["text_offset"]))]
    return text, entries


def test_logprobs_name_split_characters_by_their_bytes(http, worker, tokenizer):
    """A token that splits a character is named by its bytes (OpenAI's "bytes:\\x.." spelling), its
    ``bytes`` are its own, not U+FFFD's, and two such alternatives stay two in completions'
    top_logprobs; the bytes of the entries make the content."""
    text = "héllo 😊 wörld"
    ids = _ids(tokenizer, text)
    raws = [tokenizer.token_bytes(t) for t in ids]
    split = [i for i, b in enumerate(raws) if b.decode("utf-8", errors="replace") != b.decode("utf-8", errors="ignore")]
    assert len(split) >= 3  # the demo tokenizer splits these characters
    other = ids[split[1]]  # another split token, as each position's second alternative

    def entries(chunk):
        return [LogprobEntry(t, -0.5, [(t, -0.5), (other, -2.0)]) for t in chunk]

    worker.script = reply_script(ids, per_event=3, logprobs=entries)
    r = http.post(CHAT, json={"model": "demo", "messages": MSGS, "logprobs": True, "top_logprobs": 2}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert r["choices"][0]["message"]["content"] == text
    assert b"".join(bytes(c["bytes"]) for c in content) == text.encode()
    assert [bytes(c["bytes"]) for c in content] == raws
    for c, raw in zip(content, raws):
        assert c["token"] == (raw.decode() if raw in (raw.decode("utf-8", "ignore").encode(),) else
                              "bytes:" + "".join(f"\\x{b:02x}" for b in raw))
        assert "\ufffd" not in c["token"] and bytes(c["top_logprobs"][1]["bytes"]) == raws[split[1]]
    r = http.post(COMP, json={"model": "demo", "prompt": "x", "logprobs": 2, "max_tokens": 20}).json()
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"] == text and [len(t) for t in lp["top_logprobs"]] == [
        1 if t == other else 2 for t in ids]
    assert lp["tokens"][split[0]].startswith("bytes:\\x")
    # offsets: the whole characters before each token; one that completes a split character points
    # at that character, not at the text held back with its first bytes
    chars = [len(b"".join(raws[:i]).decode("utf-8", errors="ignore")) for i in range(len(ids))]
    assert lp["text_offset"] == chars
    # a byte that can never complete a character (a lone continuation byte) stays U+FFFD in the
    # text; the token after it starts after that U+FFFD, not at it
    lone = next(t for t in range(tokenizer.vocab_size) if tokenizer.token_bytes(t) == b"\xa2")
    tail = _ids(tokenizer, "é")  # a character split over two tokens: both start where it does
    ids = [lone, *_ids(tokenizer, ".x"), *tail]
    worker.script = reply_script(ids, per_event=1, logprobs=entries)
    r = http.post(COMP, json={"model": "demo", "prompt": "x", "logprobs": 1, "max_tokens": 20}).json()
    text, lp = r["choices"][0]["text"], r["choices"][0]["logprobs"]
    assert text == "\ufffd.xé" and len(tail) == 2
    assert lp["text_offset"] == [0, 1, 2, 3, 3]


@pytest.mark.parametrize("path", [CHAT, COMP])
def test_logprobs_stop_where_the_text_does(http, worker, tokenizer, path):
    """A stop string's tokens get no logprob entries (the token that completed it, and those whose
    text was held back with it), streamed or not; a token whose text straddles it keeps its own."""
    ids = _ids(tokenizer, "Hello world 3 5 and more")
    names = [tokenizer.token_bytes(t).decode() for t in ids]
    assert names[:5] == ["Hello", " world", " 3", " 5", " and"]
    worker.script = reply_script(ids, per_event=1, logprobs=_logprob_entries)
    for stop, want_text, kept in ((" 3 5", "Hello world", 2), ("3 5", "Hello world ", 3)):
        body = {"model": "demo", "max_tokens": 20, "stop": [stop]} | (
            {"messages": MSGS, "logprobs": True} if path == CHAT else {"prompt": "x", "logprobs": 1})
        r = http.post(path, json=body).json()
        choice = r["choices"][0]
        text = choice["message"]["content"] if path == CHAT else choice["text"]
        assert (text, choice["finish_reason"]) == (want_text, "stop")
        if path == CHAT:
            got = [c["token"] for c in choice["logprobs"]["content"]]
        else:
            got = choice["logprobs"]["tokens"]
            assert choice["logprobs"]["text_offset"] == [0, 5, 11][:kept]
        assert got == names[:kept]  # " 3" straddles "3 5" (its space is text): kept; within " 3 5": not
        assert r["usage"]["completion_tokens"] == 4  # the stop string's tokens were generated
        streamed_text, streamed = _streamed_logprobs(http, path, body)
        assert streamed_text == text
        assert [e["token"] if path == CHAT else e[0] for e in streamed] == got


def test_client_disconnect_mid_stream_publishes_abort(http, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "word " * 60), delay=0.05)
    with http.stream("POST", CHAT, json={"model": "demo", "messages": MSGS, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
    rid = httpx.Response(200, content=first[6:]).json()["id"]
    aborts = wait_for(lambda: worker.aborts_for(rid), what="the disconnect abort")
    assert [a.reason for a in aborts] == ["client_disconnected"]


def test_client_disconnect_non_stream_publishes_abort(gateway, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "word " * 60), delay=0.05)
    seen = len(worker.requests)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway + COMP, json={"model": "demo", "prompt": "x"}, timeout=httpx.Timeout(5, read=0.5))
    rid = wait_for(lambda: len(worker.requests) > seen and worker.requests[seen][0].request_id)
    aborts = wait_for(lambda: worker.aborts_for(rid), what="the disconnect abort")
    assert [a.reason for a in aborts] == ["client_disconnected"]


# --- n choices: one bus request per choice, merged into one response ------------------------------

def _per_choice(scripts: dict[str, object]):
    """A script answering choice ``<id>-<i>`` with ``scripts[i]``."""
    async def script(req, emit):
        await scripts[req.request_id.rsplit("-", 1)[1]](req, emit)
    return script


def test_n_choices_non_stream_each_its_own_request(http, worker, tokenizer):
    texts = ["Red.", "Green and blue.", "Yellow"]
    ids = [_ids(tokenizer, t) for t in texts]
    worker.script = _per_choice({str(i): reply_script(ids[i], per_event=2, cached=(0, 16, 16)[i],
                                                      finish=("stop", "length", "stop")[i]) for i in range(3)})
    seen = len(worker.requests)
    r = http.post(CHAT, json={"model": "demo", "messages": MSGS, "n": 3, "seed": 7, "temperature": 0.8})
    assert r.status_code == 200, r.text
    body = r.json()
    reqs = sorted((req for req, _ in worker.requests[seen:]), key=lambda q: q.request_id)
    assert [q.request_id for q in reqs] == [f"{body['id']}-{i}" for i in range(3)]
    assert len({tuple(q.prompt_token_ids) for q in reqs}) == 1
    # each choice draws its own tokens; a seeded request still repeats exactly
    assert [q.sampling.seed for q in reqs] == [7, 8, 9] and {q.sampling.temperature for q in reqs} == {0.8}
    prompt = len(reqs[0].prompt_token_ids)
    assert body["choices"] == [
        {"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": None,
         "finish_reason": ("stop", "length", "stop")[i]} for i in range(3)]
    # the prompt counts once; cached: what every choice found cached (the first computed it)
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": sum(map(len, ids)),
                             "total_tokens": prompt + sum(map(len, ids)), "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(worker.aborts_for(q.request_id) == [] for q in reqs)


def test_n_choices_stream_interleave_by_index(http, worker, tokenizer):
    texts = ["one two three four", "five six"]
    ids = [_ids(tokenizer, t) for t in texts]
    worker.script = _per_choice({str(i): reply_script(ids[i], delay=0.01) for i in range(2)})
    body = {"model": "demo", "prompt": "Count", "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", COMP, json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in chunks)
    by_index = {i: [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i] for i in range(2)}
    for i in range(2):
        assert "".join(c["text"] for c in by_index[i]) == texts[i]
        assert [c["finish_reason"] for c in by_index[i]][-1] == "stop"
        assert all(c["finish_reason"] is None for c in by_index[i][:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == sum(map(len, ids))
    assert usage["usage"]["prompt_tokens"] == len(tokenizer.encode("Count"))


def test_n_choices_chat_stream_starts_every_choice_with_its_role(http, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "Hi"))
    with http.stream("POST", CHAT, json={"model": "demo", "messages": MSGS, "n": 3, "stream": True}) as r:
        events = sse_events(r)
    assert [e["choices"][0] for e in events[:3]] == [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in range(3)]
    finishes = sorted(e["choices"][0]["index"] for e in events[3:-1] if e["choices"][0]["finish_reason"])
    assert finishes == [0, 1, 2]


def test_one_failing_choice_fails_the_request_and_aborts_the_others(http, worker, tokenizer):
    slow = reply_script(_ids(tokenizer, "word " * 60), delay=0.05)
    worker.script = _per_choice({"0": slow, "1": reply_script(_ids(tokenizer, "a b"), error="out of KV blocks")})
    seen = len(worker.requests)
    r = http.post(CHAT, json={"model": "demo", "messages": MSGS, "n": 2})
    assert r.status_code == 500 and "out of KV blocks" in r.json()["error"]["message"]
    rid = next(req.request_id for req, _ in worker.requests[seen:] if req.request_id.endswith("-0"))
    assert [a.reason for a in wait_for(lambda: worker.aborts_for(rid), what="the abort")] == ["gateway_error"]
    assert worker.aborts_for(rid[:-1] + "1") == []  # the worker ended that one itself
    seen = len(worker.requests)
    with http.stream("POST", CHAT, json={"model": "demo", "messages": MSGS, "n": 2, "stream": True}) as r:
        events = sse_events(r)
    assert "out of KV blocks" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    rid = next(req.request_id for req, _ in worker.requests[seen:] if req.request_id.endswith("-0"))
    assert wait_for(lambda: worker.aborts_for(rid), what="the abort")


def test_client_disconnect_aborts_every_choice(http, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "word " * 60), delay=0.05)
    with http.stream("POST", CHAT, json={"model": "demo", "messages": MSGS, "stream": True, "n": 3}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
    rid = httpx.Response(200, content=first[6:]).json()["id"]
    for i in range(3):
        aborts = wait_for(lambda: worker.aborts_for(f"{rid}-{i}"), what=f"choice {i}'s abort")
        assert [a.reason for a in aborts] == ["client_disconnected"]


def test_openai_client_reads_n_choices(gateway, worker, tokenizer):
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    texts = ["alpha", "beta gamma"]
    worker.script = _per_choice({str(i): reply_script(_ids(tokenizer, t)) for i, t in enumerate(texts)})
    out = client.completions.create(model="demo", prompt="Name", n=2, max_tokens=10)
    assert [c.text for c in out.choices] == texts and [c.index for c in out.choices] == [0, 1]
    stream = client.chat.completions.create(model="demo", messages=MSGS, n=2, stream=True)
    parts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
    assert parts == {0: texts[0], 1: texts[1]}


def test_logit_bias_reaches_the_workers_as_pairs(http, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, "ok"))
    r = http.post(COMP, json={"model": "demo", "prompt": "x", "logit_bias": {"5": 10, "77": -100.0}})
    assert r.status_code == 200, r.text
    req, _ = _last_request(worker, r.json()["id"])
    assert req.sampling.logit_bias == [(5, 10.0), (77, -100.0)]
    for bias in ({"a": 1}, {"-3": 1}, {"5": 101}, {"5": "high"}, {"5": True}, {"999999": 1}, [1, 2], {"9" * 5000: 1},
                 {str(t): 1 for t in range(1025)}):
        r = http.post(CHAT, json={"model": "demo", "messages": MSGS, "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", (bias, r.text)


# --- echo: the prompt leads the text; with logprobs, its tokens lead the logprobs -----------------

def _scoring_script(reply: list[int], scores: dict[int, float]):
    """Answers with ``reply`` in one event; its first event scores every prompt token after the
    first with ``scores.get(token, -1.0)`` when the request asked for prompt logprobs."""
    async def script(req, emit):
        k = req.sampling.prompt_logprobs
        prompt = None
        if k is not None:
            prompt = [LogprobEntry(t, scores.get(t, -1.0), [(t, -0.5)] * k) for t in req.prompt_token_ids[1:]]
        lps = [LogprobEntry(t, -0.25, [(t, -0.25)]) for t in reply] if req.sampling.logprobs is not None else None
        await emit(TokenEvent(req.request_id, 0, reply, lps, "length", None, len(req.prompt_token_ids), 0,
                              len(reply), "scripted", prompt_logprobs=prompt))
    return script


def test_echo_scores_a_prompt_with_max_tokens_0(http, worker, tokenizer):
    prompt = "The cat sat on the mat"
    ids = tokenizer.encode(prompt)
    scores = {t: -0.1 * (i + 1) for i, t in enumerate(ids)}
    worker.script = _scoring_script(_ids(tokenizer, "!"), scores)
    r = http.post(COMP, json={"model": "demo", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    req, _ = _last_request(worker, r.json()["id"])
    assert (req.sampling.prompt_logprobs, req.sampling.max_tokens) == (1, 1)  # one token, dropped
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == [tokenizer.token_bytes(t).decode() for t in ids]
    assert lp["token_logprobs"] == [None] + [scores[t] for t in ids[1:]]
    assert lp["top_logprobs"][0] is None and all(len(d) == 1 for d in lp["top_logprobs"][1:])
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(prompt)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), 0)


def test_echo_leads_the_completion_text_and_logprobs(http, worker, tokenizer):
    prompt, reply = "Once upon", _ids(tokenizer, " a time")
    worker.script = _scoring_script(reply, {})
    r = http.post(COMP, json={"model": "demo", "prompt": prompt, "echo": True, "max_tokens": 5})
    req, _ = _last_request(worker, r.json()["id"])
    assert r.json()["choices"][0]["text"] == prompt + " a time" and req.sampling.prompt_logprobs is None
    r = http.post(COMP, json={"model": "demo", "prompt": prompt, "echo": True, "max_tokens": 5, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    n = len(tokenizer.encode(prompt))
    assert len(lp["tokens"]) == n + len(reply) and lp["token_logprobs"][n:] == [-0.25] * len(reply)
    assert lp["text_offset"][n] == len(prompt)  # the completion's offsets count the echoed prompt
    with http.stream("POST", COMP, json={"model": "demo", "prompt": prompt, "echo": True, "stream": True}) as r:
        events = sse_events(r)
    assert events[0]["choices"][0]["text"].startswith(prompt)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == prompt + " a time"
    r = http.post(COMP, json={"model": "demo", "prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_batch_of_prompts_gives_n_choices_each_in_prompt_order(http, worker, tokenizer):
    prompts = ["Red", [5, 17, 300], "Blue sky"]
    replies = {str(i): _ids(tokenizer, f"answer {i}") for i in range(6)}
    worker.script = _per_choice({k: reply_script(v, cached=4) for k, v in replies.items()})
    seen = len(worker.requests)
    r = http.post(COMP, json={"model": "demo", "prompt": prompts, "n": 2, "seed": 3, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    reqs = {q.request_id: q for q, _ in worker.requests[seen:]}
    ids = [tokenizer.encode("Red"), [5, 17, 300], tokenizer.encode("Blue sky")]
    for i in range(6):  # choice i answers prompt i // n
        q = reqs[f"{body['id']}-{i}"]
        assert q.prompt_token_ids == ids[i // 2] and q.sampling.seed == 3 + i
    texts = [c["text"] for c in body["choices"]]
    echoed = ["Red", tokenizer.decode([5, 17, 300]), "Blue sky"]
    assert texts == [echoed[i // 2] + f"answer {i}" for i in range(6)]
    assert [c["index"] for c in body["choices"]] == list(range(6))
    usage = body["usage"]  # each prompt once, every completion
    assert usage["prompt_tokens"] == sum(map(len, ids))
    assert usage["completion_tokens"] == sum(map(len, replies.values()))
    assert usage["prompt_tokens_details"]["cached_tokens"] == 4 * 3


def test_a_choice_cut_by_a_stop_string_is_aborted_while_the_others_go_on(http, worker, tokenizer):
    async def waits_for_the_abort(req, emit):  # choice 1 ends only once choice 0's abort is out
        first = req.request_id[:-1] + "0"
        await emit(TokenEvent(req.request_id, 0, _ids(tokenizer, "still"), completion_tokens=1))
        for _ in range(250):
            if worker.aborts_for(first):
                await emit(TokenEvent(req.request_id, 1, _ids(tokenizer, " here"), finish_reason="length",
                                      completion_tokens=2))
                return
            await asyncio.sleep(0.02)
        await emit(TokenEvent(req.request_id, 1, finish_reason="error", error="choice 0 was never aborted"))

    worker.script = _per_choice({"0": reply_script(_ids(tokenizer, "one two STOP three four"), finish="length"),
                                 "1": waits_for_the_abort})
    r = http.post(COMP, json={"model": "demo", "prompt": "x", "n": 2, "stop": ["STOP"]})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == ["one two ", "still here"]
    assert [a.reason for a in worker.aborts_for(r.json()["id"] + "-0")] == ["stop_string"]  # once


def test_echo_with_n_choices_scores_each_prompt_once(http, worker, tokenizer):
    prompts = ["The cat sat", "A dog ran far"]
    scores = {t: -0.5 for p in prompts for t in tokenizer.encode(p)}
    worker.script = _scoring_script(_ids(tokenizer, "!"), scores)
    seen = len(worker.requests)
    r = http.post(COMP, json={"model": "demo", "prompt": prompts, "n": 3, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert r.status_code == 200, r.text
    asked = sorted((q.request_id, q.sampling.prompt_logprobs) for q, _ in worker.requests[seen:])
    body = r.json()
    # choices 0 and 3 score their prompts; their copies read the blocks from the cache instead
    assert [k for _, k in sorted(asked, key=lambda a: int(a[0].rsplit("-", 1)[1]))] == [1, None, None, 1, None, None]
    for i, choice in enumerate(body["choices"]):
        ids = tokenizer.encode(prompts[i // 3])
        assert choice["text"] == prompts[i // 3]
        assert choice["logprobs"]["token_logprobs"] == [None] + [-0.5] * (len(ids) - 1)
