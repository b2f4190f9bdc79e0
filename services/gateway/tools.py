"""Tool calls in a chat completion's text, in one of three formats (``--tool-parser``):

- ``hermes`` (Qwen2.5, Hermes, and the many models trained on it): each call a JSON object between
  ``<tool_call>`` and ``</tool_call>``, text around them allowed::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``llama3_json`` (Llama 3.1-3.3 with JSON tool calling): the whole answer is the call, a JSON
  object ``{"name", "parameters"}`` (or several joined by ``;``).

- ``mistral`` (Mistral's v3 tokenizer models: 7B Instruct v0.3, Mixtral 8x22B, NeMo, Large 2): the
  whole answer is the ``[TOOL_CALLS]`` control token then a JSON array of ``{"name", "arguments"}``.
  The token is special, so the text the gateway decodes usually lacks it: an answer that starts
  with ``[{`` (or with the token's text) is read as calls. Call ids are 9 letters and digits, the
  only ids Mistral's chat templates accept back in ``tool_call_id``. (The v7+ tokenizers'
  ``[TOOL_CALLS]name[ARGS]{...}`` is not read.)

A parser reads a choice's text as it streams: text that cannot be part of a call goes out as
content at once (hermes holds back a possible start of a tag, as stop strings are; llama3_json
holds an answer that starts with ``{`` to its end), a complete call goes out as one OpenAI tool
call (``{"id", "type": "function", "function": {"name", "arguments": "<JSON>"}}``). What is not a
call (bad JSON, no name) goes out as the text it was. ``tool_choice`` "required" or a named
function guides decoding (``forced_call_guide``): the answer is then one call, in the format.
The model's chat template must render the request's ``tools`` (it gets them as ``tools``), as it
must for any server; the gateway does not write them into the prompt itself.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid

from llmbus.guide.grammar import guide_spec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes", "llama3_json", "mistral")
MISTRAL_TAG = "[TOOL_CALLS]"
_ALNUM = string.ascii_letters + string.digits


def _call(block: str | dict, call_id: str = "") -> dict | None:
    """An OpenAI tool call from a JSON object ``{"name", "arguments" | "parameters"}`` (text or
    parsed); None when it is not one."""
    if isinstance(block, str):
        try:
            obj = json.loads(block)
        except ValueError:
            return None
    else:
        obj = block
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    # NOTE: always a JSON text: a string that is one (arguments the model encoded twice) as it is,
    # any other string as a JSON string, so the call can go back in a conversation
    arguments = args if isinstance(args, str) and _is_json(args) else json.dumps(args, ensure_ascii=False)
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ToolCallParser:
    def __init__(self) -> None:
        self._buf = ""  # held: a possible tag start, or an open block
        self.calls = 0  # tool calls found so far

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """Content that may go out now, and the calls completed by ``text``."""
        self._buf += text
        content, calls = [], []
        while True:
            start = self._buf.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, OPEN)
                content.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            content.append(self._buf[:start])
            end = _block_end(self._buf, start + len(OPEN))
            if end < 0:
                self._buf = self._buf[start:]
                break
            block = self._buf[start + len(OPEN) : end]
            call = _call(block.strip())
            if call is None:
                content.append(self._buf[: end + len(CLOSE)][start:])
            else:
                calls.append(call)
            self._buf = self._buf[end + len(CLOSE):]
        self.calls += len(calls)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict]]:
        """What is held at the end (an unclosed block, a partial tag) goes out as text."""
        rest, self._buf = self._buf, ""
        return rest, []


def _block_end(text: str, i: int) -> int:
    """Where the ``CLOSE`` tag that ends a block begins, scanning from ``i``: the first one outside a
    JSON string (an argument's text may spell the tag); -1 while there is none."""
    in_string = escaped = False
    for j in range(i, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "<" and text.startswith(CLOSE, j):
            return j
    return -1


def _json_values(text: str) -> list | None:
    """The JSON values of ``text``, joined by ``;`` (whitespace around them allowed); None when it is
    not that. A ``;`` inside a string is the string's."""
    decoder, values, i, n = json.JSONDecoder(), [], 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i == n:
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)
        while i < n and text[i].isspace():
            i += 1
        if i < n:
            if text[i] != ";":
                return None
            i += 1


class _WholeAnswerParser:
    """An answer that is either text, passed on as it comes, or calls, held and read at its end:
    ``_calls_start(head)`` says which from the answer's start (None: not yet known), ``_read(rest)``
    reads the held answer (None: it was not calls after all, and goes out as text)."""

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self.names = frozenset(names)  # the request's tools: an answer calling another is text
        self._buf = ""
        self._mode = ""  # "" undecided, "text", "calls"
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self._mode == "text":
            return text, []
        self._buf += text
        if self._mode == "calls":
            return "", []
        starts = self._calls_start(self._buf.lstrip())
        if starts is None:
            return "", []
        if starts:
            self._mode = "calls"
            return "", []
        self._mode, out, self._buf = "text", self._buf, ""
        return out, []

    def finish(self) -> tuple[str, list[dict]]:
        rest, self._buf = self._buf, ""
        if self._mode != "calls":
            return rest, []
        calls = self._read(rest)
        # NOTE: a JSON answer that merely looks like calls (a list of people with "name"s) stays text
        if not calls or None in calls or (self.names and any(c["function"]["name"] not in self.names for c in calls)):
            return rest, []
        self.calls += len(calls)
        return "", calls

    def _calls_start(self, head: str) -> bool | None:
        raise NotImplementedError

    def _read(self, rest: str) -> list[dict | None] | None:
        raise NotImplementedError


class Llama3JsonParser(_WholeAnswerParser):
    """Calls when the answer starts with ``{``: JSON objects joined by ``;``."""

    def _calls_start(self, head: str) -> bool | None:
        return head.startswith("{") if head else None

    def _read(self, rest: str) -> list[dict | None] | None:
        values = _json_values(rest)
        return None if values is None else [_call(v) for v in values]


class MistralParser(_WholeAnswerParser):
    """Calls when the answer starts with ``[TOOL_CALLS]`` or ``[{``: a JSON array."""

    def _calls_start(self, head: str) -> bool | None:
        after = head[1:].lstrip()
        if head.startswith(MISTRAL_TAG) or (head.startswith("[") and after.startswith("{")):
            return True
        if not head or MISTRAL_TAG.startswith(head) or (head.startswith("[") and not after):
            return None
        return False

    def _read(self, rest: str) -> list[dict | None] | None:
        try:
            items = json.loads(rest.lstrip().removeprefix(MISTRAL_TAG))
        except ValueError:
            return None
        items = items if isinstance(items, list) else [items]
        return [_call(item, "".join(secrets.choice(_ALNUM) for _ in range(9))) for item in items]


def forced_call_guide(tools: tuple[dict, ...], names: tuple[str, ...], parser: str) -> str:
    """The guide spec of an answer that is exactly one call, in ``parser``'s format, of one of the
    tools named (tool_choice "required" or a named function): the call's name is one of them and its
    arguments match that tool's parameters schema."""
    key = "parameters" if parser == "llama3_json" else "arguments"
    options = [{"type": "object", "required": ["name", key], "additionalProperties": False,
                "properties": {"name": {"const": fn["name"]},
                               key: fn.get("parameters") or {"type": "object"}}}
               for fn in (t["function"] for t in tools) if fn["name"] in names]  # fmt: skip
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if parser == "hermes":
        return guide_spec(schema, prefix=OPEN + "\n", suffix="\n" + CLOSE)
    if parser == "mistral":  # NOTE: no [TOOL_CALLS] prefix: a special token, which text cannot spell
        return guide_spec({"type": "array", "items": schema, "minItems": 1, "maxItems": 1})
    return guide_spec(schema)


def make_parser(name: str, tools: tuple[str, ...] = ()) -> ToolCallParser | _WholeAnswerParser:
    """``tools``: the request's tool names (a whole-answer format reads only calls of these)."""
    if name == "hermes":  # NOTE: its tags say a call is meant, whatever it names
        return ToolCallParser()
    return {"llama3_json": Llama3JsonParser, "mistral": MistralParser}[name](tools)


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could start ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
