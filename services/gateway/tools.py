"""Tool calls in a chat completion's text, in one of two formats (``--tool-parser``):

- ``hermes`` (Qwen2.5, Hermes, and the many models trained on it): each call a JSON object between
  ``<tool_call>`` and ``</tool_call>``, text around them allowed::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``llama3_json`` (Llama 3.1-3.3 with JSON tool calling): the whole answer is the call, a JSON
  object ``{"name", "parameters"}`` (or several joined by ``;``).

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
import uuid

from llmbus.guide.grammar import guide_spec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes", "llama3_json")


def _call(block: str) -> dict | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}


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
            end = self._buf.find(CLOSE, start)
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


class Llama3JsonParser:
    """The answer is either text (passed on as it comes) or, when it starts with ``{``, calls read
    at its end."""

    def __init__(self) -> None:
        self._buf = ""
        self._mode = ""  # "" undecided (only whitespace so far), "text", "json"
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self._mode == "text":
            return text, []
        self._buf += text
        head = self._buf.lstrip()
        if not head:
            return "", []
        if head.startswith("{"):
            self._mode = "json"
            return "", []
        self._mode, out, self._buf = "text", self._buf, ""
        return out, []

    def finish(self) -> tuple[str, list[dict]]:
        rest, self._buf = self._buf, ""
        if self._mode != "json":
            return rest, []
        calls = [_call(part.strip()) for part in rest.split(";") if part.strip()]
        if not calls or None in calls:
            return rest, []
        self.calls += len(calls)
        return "", calls


def forced_call_guide(tools: tuple[dict, ...], names: tuple[str, ...], parser: str) -> str:
    """The guide spec of an answer that is exactly one call, in ``parser``'s format, of one of the
    tools named (tool_choice "required" or a named function): the call's name is one of them and its
    arguments match that tool's parameters schema."""
    key = "arguments" if parser == "hermes" else "parameters"
    options = [{"type": "object", "required": ["name", key], "additionalProperties": False,
                "properties": {"name": {"const": fn["name"]},
                               key: fn.get("parameters") or {"type": "object"}}}
               for fn in (t["function"] for t in tools) if fn["name"] in names]  # fmt: skip
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if parser == "hermes":
        return guide_spec(schema, prefix=OPEN + "\n", suffix="\n" + CLOSE)
    return guide_spec(schema)


def make_parser(name: str) -> ToolCallParser | Llama3JsonParser:
    return {"hermes": ToolCallParser, "llama3_json": Llama3JsonParser}[name]()


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could start ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
