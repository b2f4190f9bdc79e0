"""Parsing and validation of /v1/completions and /v1/chat/completions bodies.

The result is a plain frozen record; tokenization, context checks and SamplingParams come later
(``prepare.py``), once the model is known.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmbus.guide.grammar import GuideError, check_guide, guide_spec
from llmbus.protocol.messages import PRIORITY_LIMIT, urgent
from services.gateway import fields as f
from services.gateway.errors import invalid, missing, wrong_type

_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHOICES = 128  # n: OpenAI's own bound
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_BATCH = 256  # completions: choices in one request (prompts x n)


@dataclass(frozen=True)
class OpenAIRequest:
    kind: str  # "completion" | "chat"
    model: str
    prompt: tuple[str | tuple[int, ...], ...] = ()  # completion: the prompts (a batch has several)
    messages: tuple[dict, ...] = ()  # chat: {"role": str, "content": str, ...}
    stream: bool = False
    n: int = 1  # choices: each its own generation over the same prompt
    echo: bool = False  # completions: the prompt leads the text (and, with logprobs, its tokens the logprobs)
    tools: tuple[dict, ...] = ()  # chat: function tools the model may call (rendered by its chat template)
    forced_tools: tuple[str, ...] = ()  # chat: tool_choice "required" (all) or named (one): it must call one
    include_usage: bool = False
    max_tokens: int | None = None  # None: the remaining context
    max_tokens_param: str = "max_tokens"  # the field that set it (chat: or max_completion_tokens)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; n: the sampled token's logprob plus the top n
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keyword arguments
    user: str | None = None
    priority: int | None = None  # smaller runs first (vLLM's extension); None: not asked (the tenant's, or 0)


def parse_completion(body: Any, max_stop: int) -> OpenAIRequest:
    body = _common_checks(body)
    for name in ("suffix", "best_of"):
        f.reject_unsupported(body, name, (None, 1) if name == "best_of" else (None,))
    logprobs = f.get_int(body, "logprobs", lo=0, hi=20)
    echo = f.get_bool(body, "echo")
    max_tokens = f.get_int(body, "max_tokens", lo=0)
    if max_tokens == 0 and not echo:  # scoring a prompt: echo it, generate nothing
        raise invalid("'max_tokens' may be 0 only with 'echo': true (to score the prompt).", "max_tokens")
    prompts, shared = _prompt(body), _shared(body, max_stop)
    if len(prompts) * shared["n"] > MAX_BATCH:
        raise invalid(f"{len(prompts)} prompts with n={shared['n']} make {len(prompts) * shared['n']} choices; "
                      f"at most {MAX_BATCH} per request.", "n")
    return OpenAIRequest(kind="completion", model=f.get_str(body, "model", required=True),
                         prompt=prompts, max_tokens=max_tokens, echo=echo, logprobs=logprobs, **shared)


def parse_chat(body: Any, max_stop: int) -> OpenAIRequest:
    body = _common_checks(body)
    for name in ("functions", "audio"):
        f.reject_unsupported(body, name)
    modalities = body.get("modalities")
    if isinstance(modalities, list) and any(m != "text" for m in modalities):  # (["text"] is what we do)
        raise invalid(f"'modalities' {modalities!r} is not supported by this server: only ['text'].", "modalities",
                      code="unsupported_parameter")
    f.reject_unsupported(body, "function_call", (None, "none"))
    tools, forced = _tools(body)
    shared = _shared(body, max_stop)
    if forced and shared["sampling"]["guide"]:
        raise invalid("'response_format' cannot be combined with a tool_choice that forces a tool call: "
                      "the output is the call.", "response_format")
    top = f.get_int(body, "top_logprobs", lo=0, hi=20)
    want = f.get_bool(body, "logprobs")
    if top is not None and not want:
        raise invalid("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    # NOTE: both checked; max_completion_tokens (max_tokens' successor) wins where both are given
    newer, older = f.get_int(body, "max_completion_tokens", lo=1), f.get_int(body, "max_tokens", lo=1)
    max_tokens, param = (older, "max_tokens") if newer is None else (newer, "max_completion_tokens")
    return OpenAIRequest(kind="chat", model=f.get_str(body, "model", required=True),
                         messages=_messages(body), max_tokens=max_tokens, max_tokens_param=param,
                         logprobs=(top or 0) if want else None, tools=tools, forced_tools=forced, **shared)


def _tools(body: dict) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """``tools`` (function tools), unless ``tool_choice`` is "none"; and the names of those the
    answer must call one of (``tool_choice`` "required": any; ``{"type": "function", "function":
    {"name": ...}}``: that one), each with a parameters schema guided decoding can serve."""
    choice = body.get("tool_choice")
    named = isinstance(choice, dict)
    if named and (choice.get("type") != "function" or not isinstance(choice.get("function"), dict)
                  or not isinstance(choice["function"].get("name"), str)):  # fmt: skip
        raise invalid("'tool_choice' must be 'none', 'auto', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}.", "tool_choice")
    if not named and choice not in (None, "auto", "none", "required"):
        raise invalid("'tool_choice' must be 'none', 'auto', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}.", "tool_choice")
    tools = body.get("tools")
    if tools is None or tools == [] or choice == "none":
        if named or choice == "required":
            raise invalid("'tool_choice' forces a tool call but the request has no 'tools'.", "tool_choice")
        return (), ()
    if not isinstance(tools, list):
        raise wrong_type("tools", "an array", tools)
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise invalid(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}.", where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise invalid(f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'.", f"{where}.function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise wrong_type(f"{where}.function.parameters", "an object (a JSON Schema)", fn["parameters"])
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise wrong_type(f"{where}.function.description", "a string", fn["description"])
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters") if k in fn}})
    names = [t["function"]["name"] for t in out]
    if named and choice["function"]["name"] not in names:
        raise invalid(f"'tool_choice' names function {choice['function']['name']!r}, which is not among the "
                      f"tools ({', '.join(names)}).", "tool_choice")
    forced = (choice["function"]["name"],) if named else tuple(names) if choice == "required" else ()
    for i, tool in enumerate(out):
        if tool["function"]["name"] in forced:
            _checked(lambda: guide_spec(tool["function"].get("parameters") or {"type": "object"}),
                     f"tools[{i}].function.parameters", "cannot guide a forced tool call")
    return tuple(out), forced


_VLLM_GUIDES = ("guided_json", "guided_choice", "guided_regex", "structured_outputs")
_OUTPUTS = {"json": "guided_json", "choice": "guided_choice", "regex": "guided_regex"}  # structured_outputs' keys


def _guide(body: dict) -> str:
    """The guide spec the request asks for ("" for free text): ``response_format``, or the
    extras clients written for vLLM send: ``guided_json`` (a schema), ``guided_choice`` (the
    answer is one of these strings), ``guided_regex`` (the answer matches it whole) or
    ``structured_outputs`` ({"json"}, {"choice"} or {"regex"})."""
    if body.get("guided_grammar") is not None:
        raise invalid("'guided_grammar' is not supported; use 'guided_json', 'guided_choice', 'guided_regex' or "
                      "'response_format'.", "guided_grammar", code="unsupported_parameter")
    fmt = _response_format(body)
    given = [name for name in _VLLM_GUIDES if body.get(name) is not None]
    if len(given) + bool(fmt) > 1:
        names = (["response_format"] if fmt else []) + given
        raise invalid(f"Give one of {', '.join(names)}: each sets what the output must be.", given[-1])
    if not given:
        return fmt
    name, value = given[0], body[given[0]]
    if name == "structured_outputs":
        keys = [k for k, v in value.items() if v is not None] if isinstance(value, dict) else []
        if len(keys) != 1 or keys[0] not in _OUTPUTS:
            raise invalid("'structured_outputs' must be {'json': <schema>}, {'choice': [...]} or {'regex': str}.", name)
        name, value = _OUTPUTS[keys[0]], value[keys[0]]
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise invalid(f"'{name}' must be a non-empty string.", name)
        spec = functools.partial(guide_spec, regex=value)
    elif name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid(f"'{name}' must be a non-empty array of non-empty strings.", name)
        spec = functools.partial(guide_spec, choice=value)
    else:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise invalid(f"'{name}' must be a JSON Schema (an object, or a string of one).", name) from None
        if not isinstance(value, dict):
            raise wrong_type(name, "an object (a JSON Schema)", value)
        spec = functools.partial(guide_spec, value)
    return _checked(spec, name)


def _response_format(body: dict) -> str:
    """The guide spec ``response_format`` asks for ("" for text): ``{"type": "json_object"}`` (any
    JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``."""
    fmt = f.get_dict(body, "response_format")
    if fmt is None or fmt.get("type") == "text":
        return ""
    kind = fmt.get("type")
    if kind == "json_object":
        return guide_spec()
    if kind != "json_schema":
        raise invalid("'response_format.type' must be 'text', 'json_object' or 'json_schema'.", "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise wrong_type("response_format.json_schema", "an object ({'name', 'schema', 'strict'})", spec)
    name = spec.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise invalid("'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'.",
                      "response_format.json_schema.name")
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise wrong_type("response_format.json_schema.schema", "an object (a JSON Schema)", schema)
    return _checked(lambda: guide_spec(schema), "response_format.json_schema.schema")


def _checked(make: Callable[[], str], param: str, what: str = "") -> str:
    """The spec ``make`` builds, once it compiles; else a 400 naming ``param`` and saying why."""
    try:
        spec = make()
        check_guide(spec)
    except GuideError as exc:
        raise invalid(f"{param}{' ' + what if what else ''}: {exc}", param) from None
    return spec


def _common_checks(body: Any) -> dict:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", None, code="invalid_request_body")
    return body


def _shared(body: dict, max_stop: int) -> dict:
    stream = f.get_bool(body, "stream")
    options = f.get_dict(body, "stream_options")
    if options is not None and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    include_usage = False
    if options is not None:  # the field named as its path in the body
        name = "stream_options.include_usage"
        include_usage = f.get_bool({name: options.get("include_usage")}, name)
    sampling = {
        "temperature": f.get_float(body, "temperature", lo=0.0, hi=2.0, default=1.0),
        "top_p": f.get_float(body, "top_p", lo=0.0, hi=1.0, default=1.0, lo_open=True),
        "top_k": f.get_int(body, "top_k", lo=-1, default=0),
        "min_p": f.get_float(body, "min_p", lo=0.0, hi=1.0, default=0.0),
        "seed": f.get_int(body, "seed", lo=-(2**63), hi=2**63 - 1),
        "presence_penalty": f.get_float(body, "presence_penalty", lo=-2.0, hi=2.0, default=0.0),
        "frequency_penalty": f.get_float(body, "frequency_penalty", lo=-2.0, hi=2.0, default=0.0),
        "repetition_penalty": f.get_float(body, "repetition_penalty", lo=0.0, hi=10.0, default=1.0,
                                          lo_open=True),
        "ignore_eos": f.get_bool(body, "ignore_eos"),
        "stop_token_ids": f.get_int_list(body, "stop_token_ids"),
        "logit_bias": f.get_logit_bias(body, "logit_bias"),
        "guide": _guide(body),
    }
    return {"stream": stream, "include_usage": include_usage, "n": f.get_int(body, "n", lo=1, hi=MAX_CHOICES, default=1),
            "stop": f.get_stop(body, "stop", max_stop), "sampling": sampling, "user": f.get_str(body, "user"),
            "priority": _priority(body)}


# OpenAI's service tiers as priorities (what the request asks for; its tenant may hold it back)
SERVICE_TIERS = {"auto": None, "default": None, "scale": None, "flex": 1, "priority": -1}


def _priority(body: dict) -> int | None:
    """The priority the request asks for: ``priority`` (vLLM's field), else its ``service_tier``
    (OpenAI's: "priority" is urgent, -1; "flex" waits, 1), else None."""
    tier = f.get_str(body, "service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise invalid(f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}.", "service_tier")
    priority = f.get_int(body, "priority", lo=-PRIORITY_LIMIT, hi=PRIORITY_LIMIT)
    return priority if priority is not None or tier is None else SERVICE_TIERS[tier]


def service_tier(priority: int) -> str:
    """The tier a response reports for the priority it ran at."""
    return "priority" if urgent(priority) else "flex" if priority > 0 else "default"


def _prompt(body: dict) -> tuple[str | tuple[int, ...], ...]:
    """A string, a list of token ids, or a batch: a list of either (each its own choices)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise missing("prompt")
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list):
        if not prompt:
            raise invalid("'prompt' must not be empty.", "prompt")
        if _token_ids(prompt):
            return (tuple(prompt),)
        if all(isinstance(p, str) or isinstance(p, list) and p and _token_ids(p) for p in prompt):
            if len(prompt) > MAX_BATCH:
                raise invalid(f"'prompt' holds at most {MAX_BATCH} prompts, got {len(prompt)}.", "prompt")
            return tuple(p if isinstance(p, str) else tuple(p) for p in prompt)
    raise wrong_type("prompt", "a string, an array of token ids, or an array of either", prompt)


def _token_ids(value: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if messages is None:
        raise missing("messages")
    if not isinstance(messages, list):
        raise wrong_type("messages", "an array", messages)
    if not messages:
        raise invalid("'messages' must contain at least one message.", "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise wrong_type(where, "an object", msg)
        role = msg.get("role")
        if role is None:
            raise missing(f"{where}.role")
        if not isinstance(role, str):
            raise wrong_type(f"{where}.role", "a string", role)
        if role not in _ROLES:
            raise invalid(f"Invalid value for '{where}.role': {role!r}; expected one of {list(_ROLES)}.",
                          f"{where}.role")
        clean = {"role": role, "content": _content(msg.get("content"), f"{where}.content", role)}
        if msg.get("name") is not None:  # (OpenAI refuses any other type too)
            if not isinstance(msg["name"], str):
                raise wrong_type(f"{where}.name", "a string", msg["name"])
            clean["name"] = msg["name"]
        if role == "assistant" and msg.get("tool_calls") is not None:
            clean["tool_calls"] = _tool_calls(msg["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            if not isinstance(msg.get("tool_call_id"), str):
                raise wrong_type(f"{where}.tool_call_id", "a string", msg.get("tool_call_id"))
            clean["tool_call_id"] = msg["tool_call_id"]
        out.append(clean)
    return tuple(out)


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, for the chat template: each
    ``{"id", "type": "function", "function": {"name", "arguments"}}``; ``arguments`` a JSON string
    (parsed for the template, as Hugging Face templates expect a mapping)."""
    if not isinstance(calls, list):
        raise wrong_type(where, "an array", calls)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str):
            raise invalid(f"'{where}[{j}]' must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}.",
                          f"{where}[{j}]")
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            raise invalid(f"'{where}[{j}].function.arguments' must be a JSON string.", f"{where}[{j}]") from None
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _content(content: Any, where: str, role: str) -> str:
    if content is None:
        if role == "assistant":
            return ""
        raise missing(where)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise wrong_type(where, "a string or an array of content parts", content)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"'{where}[{j}]' must be a text part {{'type': 'text', 'text': ...}}; "
                          "only text content is supported.", f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)
