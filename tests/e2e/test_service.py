"""The whole service, for real: `llmbus up` with a nats-server, kvpool, router, prefill, decode and
gateway processes, driven over HTTP by the `openai` client."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from llmbus.bus import subjects
from llmbus.engine.llm import LLM
from llmbus.engine.sampling_params import SamplingParams
from llmbus.guide.grammar import compile_guide, guide_spec
from tests.e2e.stack import Stack
from tests.metrics_text import labels_of, parse, total

MODEL = "demo"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    # NOTE: every prompt through prefill and the handoff (short ones would go to decode whole)
    s = Stack(MODEL, model_dir, tmp_path_factory.mktemp("e2e-data"), "--token-timeout", "10", "--tool-parser", "hermes",
              "--router-arg=--whole-threshold=0")  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(model_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_completion_greedy_equals_in_process_engine(client, reference):
    prompt = "The quick brown fox jumps over the lazy dog"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    ref = reference.generate([prompt], greedy(16))[0]
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == 16
    assert out.usage.total_tokens == len(ref.prompt_token_ids) + 16


def test_an_urgent_request_takes_the_urgent_queues_through_prefill_and_decode(client, stack, reference):
    """priority below 0 (vLLM's extra_body field): the same answer, by the urgent queues of the
    prefill lane and of the handoffs; priority 3 goes the shared way."""
    queues = [(subjects.PREFILL_STREAMS["short"], subjects.urgent_consumer(MODEL)),
              (subjects.DECODE_STREAM, subjects.urgent_consumer(MODEL)),
              (subjects.PREFILL_STREAMS["short"], subjects.prefill_consumer("short", MODEL)),
              (subjects.DECODE_STREAM, subjects.decode_consumer(MODEL))]  # fmt: skip
    before = [stack.delivered(*q) for q in queues]
    prompt = "An urgent question about the lazy dog"
    ref = reference.generate([prompt], greedy(12))[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "priority": -1})  # fmt: skip
    assert out.choices[0].text == ref.text
    assert [stack.delivered(*q) - b for q, b in zip(queues, before)] == [1, 1, 0, 0]
    other = "A question in no hurry"  # (no prefix in common: the shared queue, not one worker's)
    out = client.completions.create(model=MODEL, prompt=other, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "priority": 3})  # fmt: skip
    assert out.choices[0].text == reference.generate([other], greedy(12))[0].text
    assert [stack.delivered(*q) - b for q, b in zip(queues, before)] == [1, 1, 1, 1]


def test_streamed_chat_equals_non_streamed(client, reference):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                           extra_body={"ignore_eos": True})  # fmt: skip
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 20)
    rendered = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = reference.tokenizer.encode(rendered)
    assert usage.prompt_tokens == len(ids)
    assert whole.choices[0].message.content == reference.generate([ids], greedy(20))[0].text


def test_token_id_prompt_and_stop_string(client, reference):
    ids = [5, 17, 300, 42, 9, 77]
    ref = reference.generate([ids], greedy(24))[0]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].text == ref.text
    stop = ref.text[len(ref.text) // 2 : len(ref.text) // 2 + 3]
    if stop.strip():
        cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == ref.text[: ref.text.index(stop)]


def test_n_choices(client, stack, reference):
    prompt = "Once upon a time in a quiet village"
    ref = reference.generate([prompt], greedy(16))[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, n=3,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.text for c in out.choices] == [ref.text] * 3 and [c.index for c in out.choices] == [0, 1, 2]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ref.prompt_token_ids), 48)
    # seeded: choice i draws as a one-choice request seeded seed + i does, streamed or not
    sampled = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.9, extra_body={"ignore_eos": True})
    out = client.completions.create(n=3, seed=11, **sampled)
    alone = [client.completions.create(seed=11 + i, **sampled).choices[0].text for i in range(3)]
    assert [c.text for c in out.choices] == alone and len(set(alone)) > 1
    parts = ["", "", ""]
    for chunk in client.completions.create(n=3, seed=11, stream=True, **sampled):
        for c in chunk.choices:
            parts[c.index] += c.text
    assert parts == alone
    state = stack.wait_idle()
    assert state["kvpool_leased_blocks"] == 0
    assert all(v == (0, 0) for v in state["workers"].values()), state


def test_logit_bias(client, reference):
    prompt = "The weather today is"
    plain = reference.generate([prompt], greedy(6))[0]
    ban = {str(t): -100 for t in set(plain.token_ids)}
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logit_bias=ban,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    biased = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                            logit_bias=[(int(t), float(b)) for t, b in ban.items()])
    assert out.choices[0].text == reference.generate([prompt], biased)[0].text != plain.text


def test_a_batch_of_prompts(client, reference):
    prompts = ["The quick brown fox", "Once upon a time", [5, 17, 300, 42]]
    refs = reference.generate(prompts, greedy(8))
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.text for c in out.choices] == [r.text for r in refs for _ in range(2)]
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert out.usage.completion_tokens == 8 * 6


def test_echo_scores_the_prompt(client, reference):
    """What evaluation harnesses send to score text: echo, logprobs, max_tokens 0."""
    prompt = "The quick brown fox jumps over the lazy dog"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    ref = reference.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    choice = out.choices[0]
    assert choice.text == prompt and out.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(ref.prompt_token_ids) and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([e.logprob for e in ref.prompt_logprobs], abs=1e-4)
    assert [len(top) for top in choice.logprobs.top_logprobs[1:]] == [len({t for t, _ in e.top}) for e in ref.prompt_logprobs]
    # n choices: one scores the prompt, every choice shows its scores
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0, n=2)
    for c in out.choices:
        n = len(ref.prompt_token_ids)
        assert c.logprobs.token_logprobs[1:n] == pytest.approx([e.logprob for e in ref.prompt_logprobs], abs=1e-4)


ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"},
                                            "word": {"enum": ["yes", "no", "maybe"]},
                                            "note": {"type": "string", "maxLength": 6}},
          "required": ["ok", "n", "word", "note"], "additionalProperties": False}  # fmt: skip


def test_json_schema_output_through_prefill_handoff_and_decode(client, reference):
    """Greedy guided output equals the in-process engine's: the decode worker continues the guide
    from the tokens the prefill worker sampled."""
    messages = [{"role": "user", "content": "Answer as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=400, temperature=0, response_format=fmt)
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), ANSWER)
    ids = reference.tokenizer.encode(reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    ref = reference.generate([ids], SamplingParams(max_tokens=400, temperature=0, guide=guide_spec(ANSWER)))[0]
    assert text == ref.text
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=400, temperature=1.0, seed=7,
                                            n=2, stream=True, response_format=fmt)  # fmt: skip
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for t in texts:
        jsonschema.validate(json.loads(t), ANSWER)
    # any JSON object: the demo model writes long strings, so a short answer is a prefix of one
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                         response_format={"type": "json_object"})  # fmt: skip
    grammar = compile_guide(guide_spec())
    assert grammar.advance(grammar.initial, out.choices[0].message.content.encode()) is not None
    assert out.choices[0].message.content.startswith("{")


def test_the_openai_clients_parse_helper_gets_its_pydantic_model(client):
    """``chat.completions.parse(response_format=Model)``: the SDK sends the model's strict schema
    ($defs, $ref, anyOf with null, additionalProperties false) and parses the answer into it."""
    from typing import Literal, Optional

    from pydantic import BaseModel, Field

    class Step(BaseModel):
        name: str = Field(max_length=8)
        done: bool

    class Plan(BaseModel):
        steps: list[Step] = Field(max_length=2)
        verdict: Literal["go", "stop"]
        score: Optional[int]
        effort: int = Field(ge=1, le=5)  # minimum/maximum
        due: datetime.date  # format: date
        ticket: str = Field(pattern=r"^[A-Z]{3}-\d{3}$")

    for temperature in (0, 1.0):
        out = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Plan it."}],
                                            max_tokens=400, temperature=temperature, seed=3, response_format=Plan)
        plan = out.choices[0].message.parsed  # pydantic has validated every field
        assert isinstance(plan, Plan) and len(plan.steps) <= 2 and 1 <= plan.effort <= 5, out.choices[0].message.content


def test_the_extras_of_clients_written_for_vllm(client, reference):
    """guided_choice, guided_json, guided_regex and structured_outputs, as vLLM takes them in extra_body."""
    choices = ["positive", "negative", "neutral"]
    out = client.completions.create(model=MODEL, prompt="The review was", max_tokens=20, temperature=0,
                                    extra_body={"guided_choice": choices})  # fmt: skip
    ref = reference.generate(["The review was"], SamplingParams(max_tokens=20, temperature=0, guide=guide_spec(choice=choices)))[0]
    assert out.choices[0].text == ref.text and ref.text in choices
    for extra in ({"guided_json": ANSWER}, {"guided_json": json.dumps(ANSWER)}, {"structured_outputs": {"json": ANSWER}}):
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                             max_tokens=400, temperature=0.7, seed=2, extra_body=extra)  # fmt: skip
        jsonschema.validate(json.loads(out.choices[0].message.content), ANSWER)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick"}], max_tokens=20,
                                         extra_body={"structured_outputs": {"choice": choices}})  # fmt: skip
    assert out.choices[0].message.content in choices
    out = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=30, temperature=1.0, seed=4,
                                    extra_body={"guided_regex": r"\d{3}-\d{4}"})  # fmt: skip
    assert re.fullmatch(r"\d{3}-\d{4}", out.choices[0].text), out.choices[0].text


def test_forced_tool_calls_are_calls(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                 "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=400, temperature=0,
                                         tools=tools, tool_choice="required")  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=400, temperature=0.9, seed=1,
                                         tools=tools, tool_choice=named)  # fmt: skip
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), params["get_weather"])
    # the Responses API: the same tools in its flat shape, the call a function_call item
    flat = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in tools]
    out = client.responses.create(model=MODEL, input="What is the weather in Oslo?", max_output_tokens=400,
                                  temperature=0.9, extra_body={"seed": 3}, tools=flat,
                                  tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    assert out.status == "completed" and [i.type for i in out.output] == ["function_call"]
    assert out.output[0].name == "get_weather"
    jsonschema.validate(json.loads(out.output[0].arguments), params["get_weather"])


def test_metrics_show_the_requests_and_every_service(stack, client):
    """/metrics holds every service's own figures (asked over ``llmbus.metrics.<instance>``): one
    greedy request moves the engines', the router's and the gateway's counters by its usage."""
    url = stack.base_url.removesuffix("/v1") + "/metrics"
    before = parse(httpx.get(url, timeout=30).text)
    out = client.completions.create(model=MODEL, prompt="Count to three", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = parse(httpx.get(url, timeout=30).text)

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("llmbus_gateway_requests_total", model=MODEL, outcome="ok") == 1
    assert moved("llmbus_router_requests_total", model=MODEL, outcome="routed") == 1
    assert moved("llmbus_engine_generation_tokens_total", model=MODEL) == out.usage.completion_tokens == 5
    assert moved("llmbus_engine_prompt_tokens_total", model=MODEL, role="prefill") == out.usage.prompt_tokens
    assert moved("llmbus_engine_requests_finished_total", model=MODEL, role="prefill", reason="handoff") == 1
    assert moved("llmbus_engine_requests_finished_total", model=MODEL, role="decode", reason="length") == 1
    assert moved("llmbus_engine_step_seconds_count", model=MODEL, role="decode", kind="decode") == 4
    assert moved("llmbus_engine_step_tokens_sum", model=MODEL, role="prefill") == out.usage.prompt_tokens
    instances = stack.instances()
    for info in instances:
        if info.role != "gateway":
            assert after[f'llmbus_up{{instance="{info.instance_id}",role="{info.role}"}}'] == 1
    for info in (i for i in instances if i.role in ("prefill", "decode")):
        assert after[f'llmbus_engine_kv_blocks{{instance="{info.instance_id}",role="{info.role}",model="{MODEL}"}}'] \
            == info.total_blocks
        assert after[f'llmbus_worker_kv_blocks{{instance="{info.instance_id}",role="{info.role}"}}'] == info.total_blocks
    assert total(after, "llmbus_kvpool_blocks", role="kvpool") > 0
    assert total(after, "llmbus_kvpool_tier_capacity_bytes", role="kvpool", tier="cpu") > 0


def test_top_shows_every_service_and_the_decoders_speed(stack, client):
    """``llmbus top --once`` reads the registry and each service's metrics over the bus, while a
    stream is being generated."""
    first, done = threading.Event(), threading.Event()

    def generate():  # streams one after another until top is done, so decode is busy while it samples
        while not done.is_set():
            stream = client.completions.create(model=MODEL, prompt="Count on", max_tokens=400, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                first.set()
                if done.is_set():
                    stream.close()  # the client leaves: its request is aborted
                    break

    t = threading.Thread(target=generate)
    t.start()
    try:
        assert first.wait(60)
        r = subprocess.run([sys.executable, "-m", "llmbus.cli", "top", "--once", "--interval", "1",
                            "--nats-url", stack.nats_url], capture_output=True, text=True, timeout=60)
    finally:
        done.set()
        t.join()
    assert r.returncode == 0, r.stderr
    header, *lines = r.stdout.splitlines()
    assert header.split() == ["ROLE", "INSTANCE", "MODEL", "QUEUE", "RUN", "WAIT", "KV%", "TOK/S", "REQ/S", "STEP_MS",
                              "CACHED%", "PREEMPT"]
    rows = {line.split()[1]: line.split() for line in lines}
    for info in stack.instances():
        assert info.instance_id in rows and rows[info.instance_id][0] == info.role
    (decode,) = [row for row in rows.values() if row[0] == "decode"]
    assert float(decode[7]) > 0 and float(decode[9]) > 0  # tokens a second, and the mean step
    assert "(no answer)" not in r.stdout


def test_the_compose_dashboard_reads_only_what_the_services_export(stack, client):
    """Every metric, and every label, a panel of compose/grafana/dashboards/llmbus.json queries is
    one the running services export on the gateway's /metrics."""
    client.completions.create(model=MODEL, prompt="Count to three", max_tokens=4, temperature=0)
    text = httpx.get(stack.base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    labels: dict[str, set[str]] = {}
    for key in parse(text):
        name = re.sub(r"_(bucket|sum|count)$", "", key.split("{")[0]) if key.split("{")[0] not in families else key.split("{")[0]
        labels.setdefault(name, set()).update(labels_of(key))
    dashboard = json.loads((ROOT / "compose" / "grafana" / "dashboards" / "llmbus.json").read_text())
    targets = [t for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(targets) >= 15
    for t in targets:
        names = {re.sub(r"_(bucket|sum|count)$", "", n) if n not in families else n
                 for n in re.findall(r"llmbus_[a-z0-9_]+", t["expr"])}
        assert names <= families, f"{t['expr']}: {names - families} not exported"
        used = set(re.findall(r"\{\{(\w+)\}\}", t["legendFormat"]))
        used |= {x.strip() for group in re.findall(r"by \(([^)]*)\)", t["expr"]) for x in group.split(",")} - {"le"}
        have = set().union(*(labels.get(n, set()) for n in names))
        if have:  # (a family with no sample yet, as the refusals', shows no labels to check)
            assert used <= have, f"{t['expr']}: labels {used - have} not on {names}"


def test_the_responses_api_answers_as_chat_does(client):
    """``client.responses.create`` (OpenAI's newer API) through the real gateway: the same greedy
    text as chat for the same messages, usage and an incomplete status at max_output_tokens, and
    the streamed events in OpenAI's order."""
    ask = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Count to three"}], max_tokens=6, **ask)
    out = client.responses.create(instructions="Be brief.", input="Count to three", max_output_tokens=6, **ask)
    assert out.output_text == chat.choices[0].message.content
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    assert out.id.startswith("resp_") and out.output[0].role == "assistant"
    again = client.responses.create(input=[{"role": "developer", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "input_text", "text": "Count to three"}]}],
                                    max_output_tokens=6, **ask)
    assert again.output_text == out.output_text  # developer is system; parts are text

    types, deltas, final = [], [], None
    for event in client.responses.create(instructions="Be brief.", input="Count to three", max_output_tokens=6,
                                         stream=True, **ask):
        types.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        final = event
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(deltas) == out.output_text == final.response.output_text
    assert final.response.usage.output_tokens == 6
    from pydantic import BaseModel, Field

    class Verdict(BaseModel):
        verdict: bool
        reason: str = Field(max_length=20)

    parsed = client.responses.parse(model=MODEL, input="Is it sunny?", max_output_tokens=200, temperature=1.0,
                                    extra_body={"seed": 2},
                                    text_format=Verdict)  # text.format: a strict json_schema, guided
    assert isinstance(parsed.output_parsed, Verdict), parsed.output_text
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_123")
    assert e.value.code == "previous_response_not_found"
    # stored (the default) on the stack's bus: continued with the answer in the prompt, then gone
    again = client.responses.create(input="And then?", previous_response_id=out.id, max_output_tokens=6, **ask)
    assert again.previous_response_id == out.id and again.usage.input_tokens > out.usage.input_tokens
    assert client.responses.retrieve(out.id).output_text == out.output_text
    client.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=0)
    assert e.value.param == "max_output_tokens"


def test_32_concurrent_streams_complete_in_order(stack, reference):
    prompts = [f"Request number {i}: tell me about item {i * 7}" for i in range(32)]
    refs = reference.generate(prompts, greedy(24))

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})  # fmt: skip
        parts, usage, reasons = [], None, []
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                if chunk.choices[0].finish_reason:
                    reasons.append(chunk.choices[0].finish_reason)
            if chunk.usage:
                usage = chunk.usage
        return "".join(parts), usage, reasons

    async def main():
        client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    results = asyncio.run(main())
    for (text, usage, reasons), ref in zip(results, refs):
        assert text == ref.text
        assert reasons == ["length"]
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), 24)
    state = stack.wait_idle()
    assert state["kvpool_leased_blocks"] == 0
    assert all(v == (0, 0) for v in state["workers"].values()), state


@pytest.mark.parametrize(
    "body, status, code_or_param",
    [
        ({"model": "nope", "prompt": "hi"}, 404, "model_not_found"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "word " * 5000}, 400, "context_length_exceeded"),
        ({"model": MODEL}, 400, "prompt"),
    ],
)
def test_errors_are_openai_json(stack, body, status, code_or_param):
    r = httpx.post(f"{stack.base_url}/completions", json=body, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert code_or_param in (err["code"], err["param"])


def test_malformed_json_is_a_400(stack):
    r = httpx.post(f"{stack.base_url}/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400
    assert r.json()["error"]["message"]


def test_client_disconnect_frees_everything(stack):
    with httpx.stream("POST", f"{stack.base_url}/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Keep talking", "max_tokens": 3000, "stream": True,
                            "extra": None, "ignore_eos": True}) as r:  # fmt: skip
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen >= 5:
                break  # leaving the block closes the connection mid-stream
    state = stack.wait_idle()
    assert state["kvpool_leased_blocks"] == 0
    assert state["workers"] and all(v == (0, 0) for v in state["workers"].values()), state


def test_killed_decode_worker_ends_the_stream_with_an_error(stack):
    """Runs last in this module: a dead service takes `llmbus up` down (it is reported, not ignored)."""
    decode_pids = [i.pid for i in stack.instances() if i.role == "decode"]
    assert decode_pids
    started = None
    with httpx.stream("POST", f"{stack.base_url}/completions", timeout=60,
                      json={"model": MODEL, "prompt": "A long story", "max_tokens": 3000, "stream": True,
                            "ignore_eos": True}) as r:  # fmt: skip
        events = []
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                os.kill(decode_pids[0], signal.SIGKILL)
                started = time.monotonic()
    assert started is not None
    assert time.monotonic() - started < 45  # bounded: the gateway's silence timeout is 10 s
    assert events[-1] == "[DONE]"
    errors = [json.loads(e) for e in events[:-1] if '"error"' in e]
    assert errors and errors[-1]["error"]["message"]
    stack.proc.wait(60)
    assert stack.proc.returncode == 1
    assert "exited unexpectedly" in stack.log()


@pytest.mark.parametrize("layout", ["colocated", "handoff"])
def test_stack_with_drafts_gives_the_same_text(model_dir, tmp_path, reference, layout):
    """With `--speculative-tokens`, steps that confirm several drafted tokens stream the same
    text: `llmbus up --colocated` (prefill workers decode too: no handoff, no decode workers), and
    as it comes with every prompt handed off (the decode worker drafts from the imported context)."""
    args = ["--colocated"] if layout == "colocated" else ["--router-arg=--whole-threshold=0"]
    s = Stack(MODEL, model_dir, tmp_path / layout, *args, "--token-timeout", "10",
              "--speculative-tokens", "4", "--worker-arg=--speculative-ngram=1:3")  # fmt: skip
    try:
        assert bool([i for i in s.instances() if i.role == "decode"]) == (layout == "handoff")
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3,"  # the demo model goes on counting: drafts to confirm
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == reference.generate([prompt], greedy(48))[0].text
        assert chunks[-1].usage.completion_tokens == 48
        metrics = parse(httpx.get(s.base_url.removesuffix("/v1") + "/metrics", timeout=30).text)
        drafter = "prefill" if layout == "colocated" else "decode"
        assert total(metrics, "llmbus_engine_spec_accepted_tokens_total", model=MODEL, role=drafter) > 0
        if layout == "handoff":  # the prompt was prefilled there, then handed off
            assert total(metrics, "llmbus_engine_step_tokens_count", model=MODEL, role="prefill") > 0
        state = s.wait_idle()
        assert state["kvpool_leased_blocks"] == 0 and all(v == (0, 0) for v in state["workers"].values())
    finally:
        assert s.stop() == 0


def test_tenants_never_share_cached_prompts(model_dir, tmp_path):
    """With API keys, a tenant's prompt is cached for that tenant only: another tenant sending the
    same prompt computes it (and cannot learn, from cached_tokens or speed, that it was sent)."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-tenant-a-1": "a", "sk-tenant-b-1": "b"}))
    s = Stack(MODEL, model_dir, tmp_path / "tenants", "--colocated", "--api-keys-file", str(keys), "--token-timeout", "10")
    try:
        prompt = "A shared secret system prompt that is long enough to fill a few cache blocks. " * 3

        def cached(key: str) -> int:
            c = openai.OpenAI(base_url=s.base_url, api_key=key, max_retries=0, timeout=120)
            return c.completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage.prompt_tokens_details.cached_tokens

        assert cached("sk-tenant-a-1") == 0
        assert cached("sk-tenant-a-1") > 0  # the same tenant reads its own blocks
        assert cached("sk-tenant-b-1") == 0  # another tenant does not
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base_url, api_key="sk-nobody", max_retries=0).models.list()
    finally:
        assert s.stop() == 0


def test_two_models_of_one_shape_never_share_cached_blocks(tmp_path):
    """Two checkpoints of the same shapes, in directories of the same name, on one stack: the
    second never reads the first's blocks from kvpool (their hashes root at each checkpoint's
    digest), and answers as it does alone; each still reuses its own prompts."""
    from llmbus.model.demo import make_demo_model

    dirs = [make_demo_model(tmp_path / side / "final", "small", seed=seed) for side, seed in (("a", 0), ("b", 1))]
    # NOTE: prefill workers store a prompt's blocks in kvpool's CPU tier as they hand it off
    s = Stack("m1", dirs[0], tmp_path / "data", "--model", f"m2={dirs[1]}", "--router-arg=--whole-threshold=0",
              "--token-timeout", "30")  # fmt: skip
    try:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        prompt = list(range(100, 400))

        def ask(model: str):
            r = c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
            return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].text

        assert ask("m1")[0] == 0
        deadline = time.monotonic() + 60
        while sum(t.blocks for t in s.kvpool_stats().tiers) < len(prompt) // 16 - 1:  # m1's prompt in kvpool
            assert time.monotonic() < deadline, s.kvpool_stats()
            time.sleep(0.2)
        cached, text = ask("m2")
        assert cached == 0
        alone = LLM(dirs[1], dtype="float32", device="cpu").generate([prompt], greedy(6))[0].text
        assert text == alone
        assert ask("m2")[0] > 0 and ask("m1")[0] > 0  # each model's own blocks are reused
    finally:
        assert s.stop() == 0


def test_a_short_prompt_is_served_whole_by_the_decode_worker(model_dir, tmp_path):
    """`llmbus up` as it comes: a short prompt skips prefill and the handoff (the router's
    --whole-threshold), and the decode worker's own prefill gives the in-process engine's greedy
    tokens and logprobs; a long one still goes through prefill."""
    s = Stack(MODEL, model_dir, tmp_path / "whole", "--token-timeout", "30")
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        metrics_url = s.base_url.removesuffix("/v1") + "/metrics"
        deadline = time.monotonic() + 60
        while total(parse(httpx.get(metrics_url, timeout=30).text), "llmbus_router_workers", model=MODEL, worker_role="decode") < 1:
            assert time.monotonic() < deadline, "the router never saw the workers"  # its registry read: every 2 s
            time.sleep(0.2)
        prompt = "The quick brown fox jumps over the lazy dog"
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                           logprobs=1, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})  # fmt: skip
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        got = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
        local = LLM(model_dir, dtype="float32", device="cpu")
        want = local.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1))[0]
        assert text == want.text and chunks[-1].usage.completion_tokens == 12
        assert got == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
        long_prompt = [3 + j * 7 % 1900 for j in range(300)]
        assert client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens == 3  # fmt: skip
        after = parse(httpx.get(metrics_url, timeout=30).text)
        assert total(after, "llmbus_router_whole_total", model=MODEL) == 1
        assert total(after, "llmbus_engine_requests_finished_total", model=MODEL, role="prefill", reason="handoff") == 1
        assert total(after, "llmbus_engine_requests_finished_total", model=MODEL, role="decode", reason="length") == 2
        assert s.wait_idle()["kvpool_leased_blocks"] == 0
    finally:
        assert s.stop() == 0


def test_int4r_stack_serves_through_the_handoff(model_dir, tmp_path):
    """`llmbus up --kv-format int4r`: prefill hands rotated per-token INT4 blocks to decode through
    kvpool, with the filling block's exact keys and values (the handoff's tail rows); greedy output
    equals an in-process int4r engine's, and nothing stays leased."""
    s = Stack(MODEL, model_dir, tmp_path / "int4r", "--kv-format", "int4r", "--token-timeout", "30",
              "--router-arg=--whole-threshold=0")  # fmt: skip
    try:
        assert {i.role for i in s.instances()} >= {"prefill", "decode"}
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        prompt = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods"
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           logprobs=1, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 16
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        got = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
        local = LLM(model_dir, dtype="float32", device="cpu", kv_format="int4r")
        want = local.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1))[0]
        assert len(local.tokenizer.encode(prompt)) % 16  # a filling block to hand over
        assert text == want.text, (text, want.text)
        # the decode worker's row started from the exact tail: its logprobs are the local engine's
        # (started from its codes, they moved by up to 6e-3)
        assert got == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-5)
        state = s.wait_idle()
        assert state["kvpool_leased_blocks"] == 0 and all(v == (0, 0) for v in state["workers"].values())
    finally:
        assert s.stop() == 0


def test_a_burst_past_decode_and_kvpool_capacity_queues_instead_of_failing(model_dir, tmp_path):
    """12 concurrent 500-token prompts (35 blocks each as they decode) into a 64-block decode cache
    and a 120-block kvpool: at most one or two decode at once and three handoffs fit kvpool. Each
    fits alone, so every one must complete: handoffs wait in line for decode's blocks (their KV in
    kvpool, leases renewed), prefill waits for kvpool room. Before, most failed with "no free KV
    blocks to import" or "kvpool has N free blocks". Afterwards nothing is held anywhere."""
    s = Stack(MODEL, model_dir, tmp_path / "overload", "--kvpool-blocks", "120", "--worker-arg=--num-blocks=64",
              "--worker-arg=--max-num-seqs=16", "--token-timeout", "60")
    try:
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=300)

        async def one(i: int):
            prompt = [3 + (i * 7919 + j * 104729) % 2000 for j in range(500)]
            if i % 2:
                stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=50, temperature=0,
                                                         stream=True, stream_options={"include_usage": True},
                                                         extra_body={"ignore_eos": True})
                chunks = [c async for c in stream]
                return chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens
            r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=50, temperature=0,
                                                extra_body={"ignore_eos": True})
            return r.choices[0].finish_reason, r.usage.completion_tokens

        async def burst():
            return await asyncio.gather(*(one(i) for i in range(12)))

        assert asyncio.run(burst()) == [("length", 50)] * 12
        state = s.wait_idle()
        assert state["kvpool_leased_blocks"] == 0 and set(state["workers"].values()) == {(0, 0)}, state
        assert "Traceback" not in s.log()
    finally:
        assert s.stop() == 0
