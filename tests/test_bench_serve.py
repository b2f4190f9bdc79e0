"""`bench serve` against local servers whose timing is known.

The Starlette server streams OpenAI-shaped chunks: the first token after TTFT_S, then one every
GAP_S, usage in a final chunk. Its behaviour is chosen by the model name. A raw asyncio server
plays llama-server: usage in the chunk with the last text, no [DONE], connection cut at the end.
"""

import asyncio
import json
import statistics
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from llmbus.bench.arrivals import ArrivalProcess
from llmbus.bench.client import RequestConfig
from llmbus.bench.datasets import BenchItem
from llmbus.bench.serve import LoadConfig, run_serve
from llmbus.bench.slo import SLO

TTFT_S, GAP_S = 0.05, 0.02
_state = {"in_flight": 0, "max_in_flight": 0, "bodies": []}


def _chunk(i: int, text: str, chat: bool, finish=None, usage=None, index: int = 0) -> str:
    choice = {"index": index, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    data = {"id": f"x{i}", "choices": [choice]}
    if usage:
        data["usage"] = usage
    return "data: " + json.dumps(data) + "\n\n"


async def _completions(request):
    body = await request.json()
    _state["bodies"].append(body)
    mode, n = body["model"], body["max_tokens"]
    chat = "messages" in body
    if mode == "garbage":
        return StreamingResponse(iter(["data: [1, 2]\n\n", "data: {not json\n\n"]), media_type="text/event-stream")
    if mode == "fail500":
        return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
    if mode == "reject429" and len(_state["bodies"]) % 2 == 0:
        return JSONResponse({"error": {"message": "slow down", "type": "rate_limit"}}, status_code=429)
    per_chunk = 2 if mode == "pairs" else 1
    usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}

    async def stream():
        _state["in_flight"] += 1
        _state["max_in_flight"] = max(_state["max_in_flight"], _state["in_flight"])
        try:
            if chat:
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
            await asyncio.sleep(TTFT_S)
            sent = 0
            while sent < n:
                if sent:
                    await asyncio.sleep(GAP_S)
                if mode == "drop" and sent >= n // 2:
                    raise RuntimeError("connection dropped")  # uvicorn aborts the response mid-body
                k = min(per_chunk, n - sent)
                sent += k
                last = sent == n and mode != "gateway"
                yield _chunk(sent, "tok " * k, chat, finish="length" if last else None)
            if mode == "gateway":  # llmbus's gateway: a closing chunk with only finish_reason
                yield _chunk(n, None if chat else "", chat, finish="length")
            if mode != "nousage":
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            _state["in_flight"] -= 1

    return StreamingResponse(stream(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def server_url():
    app = Starlette(routes=[Route("/v1/completions", _completions, methods=["POST"]),
                            Route("/v1/chat/completions", _completions, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _items(n, out_len=10, prompt="hello there"):
    return [BenchItem(prompt=prompt, prompt_token_ids=[5, 6, 7], output_len=out_len) for _ in range(n)]


def _run(url, model, items, *, endpoint="completions", load=None, slo=None, warmup=()):
    cfg = RequestConfig(base_url=url, model=model, endpoint=endpoint, ignore_eos=True)
    load = load or LoadConfig(max_concurrency=4, progress=False)
    return asyncio.run(run_serve(cfg, load, items, warmup=list(warmup), slo=slo))


@pytest.mark.parametrize("mode", ["cadence", "gateway"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_metrics_match_the_known_cadence(server_url, endpoint, mode):
    records, summary = _run(server_url, mode, _items(4), endpoint=endpoint)
    assert summary["completed"] == 4 and summary["failed"] == 0
    for r in records:
        assert r.success and r.usage_reported
        assert r.output_tokens == 10 and r.prompt_tokens == 7
        assert len(r.itl_s) == 9  # every gap between the 10 token chunks; the role chunk is not a token
        assert TTFT_S * 0.9 <= r.ttft_s < TTFT_S + 0.5
        assert GAP_S * 0.9 <= r.tpot_s < GAP_S + 0.1
        assert r.e2e_s == pytest.approx(r.ttft_s + sum(r.itl_s), abs=1e-6)
    assert GAP_S * 0.9 <= summary["itl"]["median_ms"] / 1000 < GAP_S + 0.1
    assert summary["total_output_tokens"] == 40
    assert summary["output_throughput"] == pytest.approx(40 / summary["duration_s"])


def test_tokens_come_from_usage_not_chunks(server_url):
    records, _ = _run(server_url, "pairs", _items(2))
    for r in records:
        assert r.output_tokens == 10 and len(r.itl_s) == 4  # 5 chunks of 2 tokens
        # 4 gaps of at least GAP_S spread over 9 token intervals (TPOT divides by output_tokens - 1)
        assert 0.9 * 4 * GAP_S / 9 <= r.tpot_s


def test_missing_usage_falls_back_to_chunks_and_is_flagged(server_url):
    records, summary = _run(server_url, "nousage", _items(2, out_len=6))
    assert all(r.success and not r.usage_reported and r.output_tokens == 6 for r in records)
    assert summary["usage_missing"] == 2


def test_request_body_streams_with_usage_and_ignore_eos(server_url):
    _state["bodies"].clear()
    _run(server_url, "cadence", _items(1, out_len=3))
    body = _state["bodies"][-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 3 and body["prompt"] == "hello there"


def test_token_id_prompts_and_extra_body(server_url):
    _state["bodies"].clear()
    cfg = RequestConfig(base_url=server_url, model="cadence", prompt_format="ids", extra_body={"min_tokens": 2})
    records, _ = asyncio.run(run_serve(cfg, LoadConfig(progress=False), _items(1, out_len=2)))
    body = _state["bodies"][-1]
    assert body["prompt"] == [5, 6, 7] and body["min_tokens"] == 2 and "ignore_eos" not in body
    assert "top_p" not in body  # the server's default unless asked
    assert records[0].success
    nucleus = RequestConfig(base_url=server_url, model="cadence", temperature=0.8, top_p=0.9)
    asyncio.run(run_serve(nucleus, LoadConfig(progress=False), _items(1, out_len=2)))
    assert _state["bodies"][-1]["top_p"] == 0.9 and _state["bodies"][-1]["temperature"] == 0.8


def test_server_errors_are_reported_not_raised(server_url):
    records, summary = _run(server_url, "fail500", _items(3))
    assert summary["failed"] == 3 and summary["errors_by_status"] == {"500": 3}
    assert all(r.error == "boom" for r in records)
    _state["bodies"].clear()
    _, summary = _run(server_url, "reject429", _items(4), load=LoadConfig(max_concurrency=1, progress=False))
    assert summary["completed"] == 2 and summary["errors_by_status"] == {"429": 2}


def test_malformed_stream_is_an_error(server_url):
    records, summary = _run(server_url, "garbage", _items(2))
    assert summary["errors_by_status"] == {"stream": 2}
    assert all("JSON object" in r.error for r in records)


def test_dropped_connection_is_an_error(server_url):
    records, summary = _run(server_url, "drop", _items(2))
    assert summary["failed"] == 2 and summary["errors_by_status"] == {"stream": 2}
    assert all(not r.success and r.error for r in records)


def test_refused_connection_is_an_error():
    records, summary = _run("http://127.0.0.1:9", "cadence", _items(2))
    assert summary["errors_by_status"] == {"connection": 2}
    assert all("Connect" in r.error for r in records)


def test_cli_exits_1_when_no_request_succeeds(tmp_path, capsys):
    from llmbus.bench.tinymodel import write_tokenizer
    from llmbus.cli import main

    write_tokenizer(str(tmp_path), vocab_size=300)
    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(tmp_path),
               "--num-prompts", "2", "--no-progress", "--out", str(out)])
    assert rc == 1
    captured = capsys.readouterr()
    assert "0 ok / 2 failed" in captured.out
    assert json.loads(out.read_text())["summary"]["failed"] == 2
    # and why: the first failure's error, not just that there were failures
    assert "no request succeeded; the first failed with:" in captured.err and "Connect" in captured.err


def test_max_concurrency_caps_in_flight_requests(server_url):
    _state["max_in_flight"] = 0
    _run(server_url, "cadence", _items(8, out_len=4), load=LoadConfig(max_concurrency=3, progress=False))
    assert _state["max_in_flight"] == 3


def test_arrivals_spread_the_requests(server_url):
    load = LoadConfig(arrivals=ArrivalProcess(rate=20.0, process="constant"), progress=False)
    records, _ = _run(server_url, "cadence", _items(5, out_len=2), load=load)
    assert [r.arrival_s for r in records] == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2])
    assert all(r.start_s >= r.arrival_s - 1e-3 for r in records)


def test_goodput_counts_requests_meeting_the_slo(server_url):
    _, summary = _run(server_url, "cadence", _items(3, out_len=4), slo=SLO.parse(["ttft:10000", "tpot:10000"]))
    assert summary["good_requests"] == 3
    _, summary = _run(server_url, "cadence", _items(3, out_len=4), slo=SLO.parse(["ttft:1"]))
    assert summary["good_requests"] == 0 and summary["goodput"] == 0


def test_warmup_is_not_measured(server_url):
    _state["bodies"].clear()
    records, summary = _run(server_url, "cadence", _items(2, out_len=2), warmup=_items(3, out_len=1, prompt="w"))
    assert len(_state["bodies"]) == 5 and len(records) == 2 and summary["num_requests"] == 2


async def _llama_style(reader, writer):
    """One response per connection: usage rides with the last text, no [DONE], abrupt close."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    body = json.loads(await reader.readexactly(length))
    n = body["max_tokens"]
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    await asyncio.sleep(TTFT_S)
    for i in range(1, n + 1):
        for choice in range(body.get("n", 1)):  # each choice's usage rides on its own last chunk
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3} if i == n else None
            data = _chunk(i, "t", False, finish="length" if i == n else None, usage=usage, index=choice).encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()
            await asyncio.sleep(GAP_S)
    writer.close()  # NOTE: no terminating zero-length chunk: the client sees the body cut short


def test_llama_server_quirks_are_counted_right():
    async def main():
        server = await asyncio.start_server(_llama_style, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            cfg = RequestConfig(base_url=f"http://127.0.0.1:{port}/v1", model="gguf")
            return await run_serve(cfg, LoadConfig(max_concurrency=1, progress=False), _items(3, out_len=5))

    records, summary = asyncio.run(main())
    assert summary["completed"] == 3, [r.error for r in records]
    for r in records:
        assert r.usage_reported and r.output_tokens == 5 and len(r.itl_s) == 4
        assert TTFT_S * 0.9 <= r.ttft_s and GAP_S * 0.9 <= r.tpot_s < GAP_S + 0.1


def test_usage_per_choice_is_summed_over_n_choices():
    async def main():
        server = await asyncio.start_server(_llama_style, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            cfg = RequestConfig(base_url=f"http://127.0.0.1:{port}/v1", model="gguf", extra_body={"n": 3})
            return await run_serve(cfg, LoadConfig(max_concurrency=1, progress=False), _items(2, out_len=4))

    records, summary = asyncio.run(main())
    assert summary["completed"] == 2, [r.error for r in records]
    assert all(r.usage_reported and r.output_tokens == 12 and r.prompt_tokens == 3 for r in records)


@pytest.mark.parametrize("kwargs,match", [
    ({"endpoint": "embeddings"}, "endpoint"), ({"base_url": "localhost:8000"}, "http://"),
    ({"endpoint": "chat", "prompt_format": "ids"}, "completions"), ({"top_p": 0.0}, "top_p"),
])
def test_bad_request_config_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RequestConfig(**{"base_url": "http://x", "model": "m", **kwargs})


def test_statistics_helper_matches_python():
    from llmbus.bench.metrics import percentile

    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.5]
    assert percentile(xs, 50) == pytest.approx(statistics.median(xs))
    assert percentile(xs, 90) == pytest.approx(statistics.quantiles(xs, n=10, method="inclusive")[8])
