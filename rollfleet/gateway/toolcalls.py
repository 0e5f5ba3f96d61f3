"""OpenAI function calling on the chat route: ``tools`` checked on the way in, ``tool_calls`` out.

The model writes its calls as text in its own format (Hermes: ``<tool_call>{json}</tool_call>``);
an agent built on the OpenAI SDK expects them parsed into ``message.tool_calls`` with
``finish_reason: "tool_calls"``. The parser is a plug-in (``gateway.tool_call_parser``, the
registry of :mod:`rollfleet.tool_parser`). A reply with a malformed call is returned as plain
text, as vLLM does: half a call cannot be run, and the agent still sees what the model wrote.

Streamed, a reply that may call tools goes out as it is sampled up to the parser's call marker
(``<tool_call>``; text that may be the start of one waits for the next tokens), and its calls
follow, parsed, in one delta when the reply ends (:class:`ToolCallStream`).

``tool_choice`` values that need constrained decoding (``"required"``, a named function) are
refused rather than silently ignored; a caller can constrain sampling itself with
``structured_outputs`` (see :mod:`rollfleet.gateway.protocol`).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Optional

from rollfleet.gateway.errors import bad_request
from rollfleet.tool_parser import get_tool_parser

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_tools(tools: Optional[list[dict[str, Any]]], tool_choice: Any) -> None:
    """Refuse malformed ``tools`` and unsupported ``tool_choice``, naming the field."""
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where}.type", 'each tool must be {"type": "function", "function": {...}}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{where}.function", "must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"{where}.function.name", "must be 1-64 letters, digits, '_', '.' or '-'")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters", "must be a JSON Schema object")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"{where}.function.description", "must be a string")
    if tool_choice in (None, "auto", "none"):
        return
    raise bad_request(
        "tool_choice",
        f"tool_choice {tool_choice!r} is not turned into a constraint by this gateway; use 'auto' or 'none' "
        "(structured_outputs constrains sampling directly)",
        code="unsupported_value",
    )


class ToolCallFormatter:
    """Turns a reply's text into an assistant message, with ``tool_calls`` when it made any."""

    def __init__(self, parser: str) -> None:
        self.parser = get_tool_parser(parser)

    def message(self, text: str, *, parse: bool) -> tuple[dict[str, Any], bool]:
        """``(assistant message, whether it calls tools)``."""
        if parse:
            parsed = self.parser.parse(text)
            if parsed.tool_calls and all(c.error is None for c in parsed.tool_calls):
                calls = [
                    {
                        "id": f"call_{secrets.token_hex(12)}",
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                    }
                    for c in parsed.tool_calls
                ]
                return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, True
        return {"role": "assistant", "content": text}, False

    def stream(self) -> Optional["ToolCallStream"]:
        """A gate for one streamed reply, or None when this format has no call marker."""
        return ToolCallStream(self) if self.parser.call_start else None


class ToolCallStream:
    """The content of a streamed reply that may call tools: what can be shown before the calls."""

    def __init__(self, formatter: ToolCallFormatter) -> None:
        assert formatter.parser.call_start is not None
        self.formatter = formatter
        self.marker = formatter.parser.call_start
        self.text = ""
        self.sent = 0  # characters of text already shown
        self.calling = False  # the marker has shown up: everything after it waits for the end

    def push(self, piece: str) -> str:
        """Add decoded text; return what can be shown now."""
        self.text += piece
        if self.calling:
            return ""
        at = self.text.find(self.marker, max(0, self.sent - len(self.marker)))
        if at >= 0:
            self.calling, end = True, at
        else:
            end = len(self.text) - _partial_marker(self.text, self.marker)
        shown = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return shown

    def finish(self) -> tuple[str, dict[str, Any], bool]:
        """At the end: ``(text still to show, assistant message, whether it calls tools)``; with
        calls, only the calls themselves are held back: text the model wrote after them is still
        to show (a malformed call is shown as text). The message's content is exactly what the
        stream showed, so that the caller's next turn, built from it, extends this one."""
        message, calls = self.formatter.message(self.text, parse=True)
        shown = self.text[: self.sent]
        if not calls:
            rest = self.text[self.sent :]
        else:
            content = message.get("content") or ""
            lead = shown.lstrip()  # the parsed content is stripped: a reply that began "\n" lost its rest
            rest = content[len(lead) :] if content.startswith(lead) else ""
            message["content"] = (shown + rest) or None
        self.sent = len(self.text)
        return rest, message, calls


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (it may be completed next)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


__all__ = ["check_tools", "ToolCallFormatter", "ToolCallStream"]
