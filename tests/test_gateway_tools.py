"""Tool calls: the hermes parser on its own (any split of the text), and the gateway with
``--tool-parser hermes`` against a scripted worker: the tools reach the chat template, calls come
back as OpenAI tool calls (streamed and not, through the openai client too)."""

from __future__ import annotations

import itertools
import json
import random
import shutil

import openai
import pytest

from llmbus.guide.grammar import compile_guide
from services.gateway.responses import answer_turn
from services.gateway.tools import Llama3JsonParser, MistralParser, ToolCallParser, forced_call_guide, make_parser
from tests.test_gateway_harness import (  # noqa: F401
    GatewayProcess, gw_nats, model_dir, reply_script, scratch, sse_events, tokenizer, worker,
)
from tests.test_gateway_stream import CHAT, _ids, _last_request

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
CALL_B = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
TEXT = "Let me check. " + CALL_A + "\n" + CALL_B + " <tool_ca"


def _run(chunks: list[str], p=None) -> tuple[str, list[dict]]:
    p = p or ToolCallParser()
    content, calls = [], []
    for c in chunks:
        text, new = p.feed(c)
        content.append(text)
        calls += new
    rest, more = p.finish()
    content.append(rest)
    return "".join(content), calls + more


@pytest.mark.parametrize("seed", range(20))
def test_calls_are_read_however_the_text_is_split(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randrange(1, 30)))
    chunks = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)])]
    content, calls = _run(chunks)
    assert content == "Let me check. \n <tool_ca"  # a tag that never completes goes out as text
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Paris", "unit": "C"}), ("function", "get_time", {})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize("seed", range(5))
def test_a_tag_or_semicolon_inside_an_argument_string_is_the_argument_s(seed):
    """An argument may spell ``</tool_call>`` (hermes) or ``;`` (llama3_json): only one outside
    a JSON string ends a call. A forced call with such an argument came back as text."""
    split = _splitter(seed)
    tricky = {"sql": "select 1; select 2", "note": 'ends with </tool_call> and a \\" quote'}
    block = "<tool_call>\n" + json.dumps({"name": "run", "arguments": tricky}) + "\n</tool_call>"
    content, calls = _run(split("Sure. " + block + " done"))
    assert content == "Sure.  done" and [json.loads(c["function"]["arguments"]) for c in calls] == [tricky]
    two = json.dumps({"name": "run", "parameters": tricky}) + " ; " + json.dumps({"name": "f", "parameters": {}})
    content, calls = _run(split(two), Llama3JsonParser())
    assert content == "" and [json.loads(c["function"]["arguments"]) for c in calls] == [tricky, {}]
    for text in ('{"name": "f", "parameters": {}} oops', '{"name": "f", "parameters": {}};;'):  # not calls
        assert _run(split(text), Llama3JsonParser()) == (text, [])


def test_what_is_not_a_call_stays_text():
    for block in ("<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                  '<tool_call>["get_time"]</tool_call>'):
        assert _run([block]) == (block, [])
    assert _run(["<tool_call>{\"name\": \"f\""]) == ("<tool_call>{\"name\": \"f\"", [])  # never closed
    p = ToolCallParser()
    assert p.feed("a <tool") == ("a ", []) and p.feed("box>") == ("<toolbox>", [])


def test_a_calls_arguments_are_always_json_text():
    """Arguments given as a string that is JSON stay as they are; any other string becomes a JSON
    string, so the call can be sent back in a conversation (and stored with a response)."""
    _, calls = _run(['<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
                     '<tool_call>{"name": "g", "arguments": "oops"}</tool_call>'])
    assert [c["function"]["arguments"] for c in calls] == ['{"x": 1}', '"oops"']
    answer = {"output": [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                          "arguments": c["function"]["arguments"]} for c in calls]}  # fmt: skip
    assert [m["function"]["arguments"] for m in answer_turn(answer)[0]["tool_calls"]] == ['{"x": 1}', '"oops"']


def _splitter(seed: int):
    """A function cutting a text into random pieces, as a stream's tokens would."""
    rng = random.Random(seed)

    def split(text):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12))))
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]

    return split


@pytest.mark.parametrize("seed", range(5))
def test_llama3_json_calls_are_the_whole_answer(seed):
    split = _splitter(seed)

    two = ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    content, calls = _run(split(two), Llama3JsonParser())
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    for text in ("It is sunny in Oslo.", "  {not json at all", '{"city": "Oslo"}'):  # text, bad JSON, no name
        assert _run(split(text), Llama3JsonParser()) == (text, [])
    p = Llama3JsonParser()  # plain text streams at once, not held to the end
    assert p.feed("  ") == ("", []) and p.feed("Hi") == ("  Hi", []) and p.feed(" there") == (" there", [])
    assert isinstance(make_parser("llama3_json"), Llama3JsonParser) and isinstance(make_parser("hermes"), ToolCallParser)


@pytest.mark.parametrize("seed", range(5))
def test_mistral_calls_are_a_json_array_after_the_control_token(seed):
    split = _splitter(seed)

    calls_json = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'
    for answer in ("[TOOL_CALLS]" + calls_json, " " + calls_json, "[TOOL_CALLS] " + calls_json):
        content, calls = _run(split(answer), MistralParser())
        assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)  # what Mistral's templates take back
    for text in ("It is sunny.", "[1] The first source says", "[TOOL_CALLS] not json", '[{"city": "Oslo"}]', "[TOOL"):
        assert _run(split(text), MistralParser()) == (text, [])
    people = '[{"name": "Alice", "age": 3}, {"name": "Bob"}]'  # JSON that only looks like calls
    assert _run(split(people), MistralParser(("get_weather", "get_time"))) == (people, [])
    assert _run(split(calls_json), MistralParser(("get_weather", "get_time")))[1]
    assert _run(['{"name": "Alice", "age": 3}'], Llama3JsonParser(("get_weather",))) == ('{"name": "Alice", "age": 3}', [])
    p = MistralParser()  # text streams as soon as it cannot be calls
    assert p.feed(" [") == ("", []) and p.feed("1] a") == (" [1] a", []) and p.feed("nd") == ("nd", [])
    assert isinstance(make_parser("mistral"), MistralParser)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _tools_model(model_dir, scratch):
    """A copy of the model whose chat template shows the tools and earlier calls (as tool-calling
    models' templates do)."""
    path = scratch / "tools-model"
    if not path.exists():
        shutil.copytree(model_dir, path)
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = (
            "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
            "{% for c in m.get('tool_calls', []) %}[call {{ c.function.name }} city={{ c.function.arguments.city }}]"
            "{% endfor %}{% if m.get('tool_call_id') %} (for {{ m['tool_call_id'] }}){% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _tools_gateway(parser: str, gw_nats, model_dir, scratch):
    """A gateway reading ``parser``'s tool calls over the tools model."""
    proc = GatewayProcess(gw_nats, _tools_model(model_dir, scratch), scratch / f"gateway-tools-{parser}.log",
                          ("--tool-parser", parser, "--max-model-len", "1024"))
    yield proc.url
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def tools_gateway(gw_nats, model_dir, worker, scratch):
    yield from _tools_gateway("hermes", gw_nats, model_dir, scratch)


@pytest.fixture(scope="module")
def mistral_gateway(gw_nats, model_dir, worker, scratch):
    yield from _tools_gateway("mistral", gw_nats, model_dir, scratch)


def test_a_call_comes_back_as_an_openai_tool_call(tools_gateway, worker, tokenizer):
    import httpx

    worker.script = reply_script(_ids(tokenizer, "Sure. " + CALL_A), per_event=3)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with httpx.Client(base_url=tools_gateway, timeout=30) as http:
        r = http.post(CHAT, json={"model": "demo", "messages": history, "tools": TOOLS})
        assert r.status_code == 200, r.text
        body = r.json()
        req, _ = _last_request(worker, body["id"])
        prompt = tokenizer.decode(req.prompt_token_ids)
        assert '"name": "get_weather"' in prompt and "[call get_weather city=Rome]" in prompt and "(for call_1)" in prompt
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
        with http.stream("POST", CHAT, json={"model": "demo", "messages": history, "tools": TOOLS, "stream": True}) as s:
            events = sse_events(s)
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == "Sure. "
        streamed = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [(c["index"], c["function"]["name"]) for c in streamed] == [(0, "get_weather")]
        assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    client = openai.OpenAI(base_url=tools_gateway + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model="demo", messages=history, tools=TOOLS)
    assert out.choices[0].message.tool_calls[0].function.name == "get_weather"
    worker.script = reply_script(_ids(tokenizer, "No tool needed."))
    out = client.chat.completions.create(model="demo", messages=history, tools=TOOLS)
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == ("No tool needed.", "stop")
    assert out.choices[0].message.tool_calls is None


def test_the_responses_api_calls_functions_as_chat_does(tools_gateway, worker, tokenizer):
    """``client.responses`` with function tools: earlier calls and their outputs (input items)
    reach the chat template as chat's do, and a call in the answer is a ``function_call`` item,
    streamed as OpenAI's events, which the openai client's stream helper assembles."""
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    client = openai.OpenAI(base_url=tools_gateway + "/v1", api_key="unused", max_retries=0)
    worker.script = reply_script(_ids(tokenizer, "Sure. " + CALL_A), per_event=3)
    before = len(worker.requests)
    out = client.responses.create(model="demo", input=history, tools=tools)
    (req, _), = worker.requests[before:]
    prompt = tokenizer.decode(req.prompt_token_ids)
    assert '"name": "get_weather"' in prompt and "[call get_weather city=Rome]" in prompt and "(for call_1)" in prompt
    assert out.status == "completed" and [i.type for i in out.output] == ["message", "function_call"]
    assert out.output_text == "Sure."
    call = out.output[1]
    assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Paris", "unit": "C"}, "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and out.tools[0].name == "get_weather"
    with client.responses.stream(model="demo", input=history, tools=tools) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds.count("response.function_call_arguments.done") == 1 and kinds[-1] == "response.completed"
    assert [i.type for i in final.output] == ["message", "function_call"]
    assert json.loads(final.output[1].arguments) == {"city": "Paris", "unit": "C"}
    # the client answers the call: the next turn carries it back as input items
    worker.script = reply_script(_ids(tokenizer, "It is sunny in Paris."))
    out = client.responses.create(model="demo", tools=tools, input=[
        *history[:1], *[i.model_dump(exclude_none=True) for i in final.output if i.type == "function_call"],
        {"type": "function_call_output", "call_id": final.output[1].call_id, "output": "sunny"}])
    assert (out.output_text, [i.type for i in out.output]) == ("It is sunny in Paris.", ["message"])


def test_a_streamed_responses_item_is_done_before_the_next_is_added(tools_gateway, worker, tokenizer):
    """Text around two calls, streamed as OpenAI streams a response: each output item added,
    streamed and done before the next is added, ``output_index`` counting them in that order, and
    the final response listing those items (same ids) in that order, as the unstreamed answer does
    (the message first, with the text after the calls too); the openai client's stream helper
    assembles the same."""
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]  # fmt: skip
    worker.script = reply_script(_ids(tokenizer, "Sure. " + CALL_A + " Then " + CALL_B + " done."), per_event=3)
    ask = dict(model="demo", input="Weather and time in Paris?", tools=tools)
    client = openai.OpenAI(base_url=tools_gateway + "/v1", api_key="unused", max_retries=0)
    plain = client.responses.create(**ask)
    events = list(client.responses.create(stream=True, **ask))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.status == "completed"
    of_items = [e for e in events if getattr(e, "output_index", None) is not None]
    assert len(of_items) == len(events) - 3  # every event between in_progress and completed
    runs = [list(run) for _, run in itertools.groupby(of_items, key=lambda e: e.output_index)]
    assert [run[0].output_index for run in runs] == list(range(len(runs)))  # one unbroken run per item, in order
    assert all((run[0].type, run[-1].type) == ("response.output_item.added", "response.output_item.done") for run in runs)
    assert [run[0].item.id for run in runs] == [run[-1].item.id for run in runs] == [i.id for i in final.output]
    assert [run[-1].item for run in runs] == final.output

    def shape(output):
        return [(i.type, i.content[0].text) if i.type == "message" else (i.type, i.name, json.loads(i.arguments))
                for i in output]  # fmt: skip

    assert shape(final.output) == shape(plain.output) == [
        ("message", "Sure.  Then  done."), ("function_call", "get_weather", {"city": "Paris", "unit": "C"}),
        ("function_call", "get_time", {})]
    with client.responses.stream(**ask) as stream:
        helped = list(stream)
        assembled = stream.get_final_response()
    assert [e.type for e in helped] == [e.type for e in events]
    done = [e.item for e in helped if e.type == "response.output_item.done"]
    assert [i.id for i in done] == [i.id for i in assembled.output] and shape(done) == shape(assembled.output)
    assert shape(assembled.output) == shape(final.output)
    last_text = [e for e in helped if e.type == "response.output_text.delta"][-1]
    assert last_text.snapshot == assembled.output_text == "Sure.  Then  done."


def test_mistral_calls_come_back_with_ids_its_templates_take(mistral_gateway, worker, tokenizer):
    worker.script = reply_script(_ids(tokenizer, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
                                 per_event=2)
    client = openai.OpenAI(base_url=mistral_gateway + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    out = client.chat.completions.create(model="demo", messages=ask, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    assert len(call.id) == 9 and call.id.isalnum()
    streamed = [c for chunk in client.chat.completions.create(model="demo", messages=ask, tools=TOOLS, stream=True)
                for choice in chunk.choices for c in (choice.delta.tool_calls or [])]
    assert [c.function.name for c in streamed] == ["get_weather"]
    worker.script = reply_script(_ids(tokenizer, "It is sunny."))
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    out = client.chat.completions.create(model="demo", messages=history, tools=TOOLS)
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == ("It is sunny.", "stop")
    req, _ = _last_request(worker, out.id)
    assert f"(for {call.id})" in tokenizer.decode(req.prompt_token_ids)


def test_up_hands_the_tool_parser_to_the_gateway(model_dir):
    import argparse

    from llmbus.launch import _plan, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["up", "--model", f"m={model_dir}", "--tool-parser", "hermes"])
    gateway = next(c for c in _plan(args, "nats://127.0.0.1:4222", [("m", str(model_dir))]) if c.name == "gateway")
    assert gateway.argv[gateway.argv.index("--tool-parser") + 1] == "hermes"


@pytest.mark.parametrize("parser, call", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}'),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
])
def test_a_forced_call_is_one_call_in_the_parsers_format(parser, call):
    grammar = compile_guide(forced_call_guide(tuple(TOOLS), ("get_weather",), parser))
    assert grammar.matches(call.encode())
    assert not grammar.matches(call.replace("get_weather", "get_time").encode())
    content, calls = _run([call], make_parser(parser))
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather"]
