"""Tool calls in a chat completion's text: the ``hermes`` format (Qwen2.5, Hermes, and the many models
trained on it), each call a JSON object between ``<tool_call>`` and ``</tool_call>``::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``ToolCallParser`` reads a choice's text as it streams: text outside the tags goes out as content
(a possible start of a tag is held back, as stop strings are), a complete block goes out as one
OpenAI tool call (``{"id", "type": "function", "function": {"name", "arguments": "<JSON>"}}``). A
block that is not a call (bad JSON, no name) goes out as the text it was. The model's chat
template must render the request's ``tools`` (it gets them as ``tools``), as it must for any
server; the gateway does not write them into the prompt itself.
"""

from __future__ import annotations

import json
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)


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

    def finish(self) -> str:
        """What is held at the end (an unclosed block, a partial tag) goes out as text."""
        rest, self._buf = self._buf, ""
        return rest


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could start ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
