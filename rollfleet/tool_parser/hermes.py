"""Hermes / Qwen2.5 / Qwen3 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

An opening tag without its closing tag is not a call: it is left in the content (half a call
cannot be run). Whoever knows why the text ended decides: the tool agent tells the model its
call was never closed (a budget cut ends the trajectory before it parses), the gateway returns
the text as content.
"""

from __future__ import annotations

import json
from typing import Optional

from rollfleet.tool_parser.base import FunctionCall, ParsedResponse, ToolParser

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    call_start = _OPEN

    def parse(self, text: str) -> ParsedResponse:
        calls: list[FunctionCall] = []
        content, pos = [], 0
        for i, (start, end, body) in enumerate(_calls(text)):
            calls.append(_parse_one(body.strip(), f"call_{i}"))
            content.append(text[pos:start])
            pos = end
        content.append(text[pos:])
        return ParsedResponse(content="".join(content).strip(), tool_calls=calls)


def _calls(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, body)`` of every closed call. A body that is one JSON value followed by a
    closing tag ends there, even past a closing tag inside one of its strings (a call whose
    arguments quote ``</tool_call>``, code that prints it, used to end inside its own string: a
    valid call answered as invalid JSON, the rest left in the content); any other body ends at the
    first closing tag. An opening tag whose body is no call is passed over for the next one before
    that closing tag (an unclosed one in the model's thinking or prose used to swallow the call):
    a failed decode stops at its first bad character, so stray tags cost little each."""
    out = []
    pos = 0
    while (start := text.find(_OPEN, pos)) >= 0:
        body = start + len(_OPEN)
        close = text.find(_CLOSE, body)
        if close < 0:
            break  # not closed: left in the content (see the module docstring)
        end = _json_end(text, body)
        if end is None or not text.startswith(_CLOSE, end):
            inner = text.find(_OPEN, body, close)
            if inner >= 0:  # a stray opening tag (in thought, in prose) before a call: try the next one
                pos = inner  # (the next, not the last: the call's own JSON may quote the tag)
                continue
        elif end > close:
            close = end
        out.append((start, close + len(_CLOSE), text[body:close]))
        pos = close + len(_CLOSE)
    return out


_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


def _json_end(text: str, at: int) -> Optional[int]:
    """Where the whitespace after the JSON value starting at ``at`` ends, or None if none starts."""
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    try:
        _, end = _DECODER.raw_decode(text, at)
    except (json.JSONDecodeError, RecursionError):
        return None
    while end < len(text) and text[end] in _WHITESPACE:
        end += 1
    return end


def _parse_one(raw: str, call_id: str) -> FunctionCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return FunctionCall(name="", id=call_id, error=f"tool call is not valid JSON: {exc.msg}", raw=raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return FunctionCall(name="", id=call_id, error='tool call needs a "name" string', raw=raw)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return FunctionCall(name=obj["name"], id=call_id, error=f"arguments are not valid JSON: {exc.msg}", raw=raw)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return FunctionCall(name=obj["name"], id=call_id, error='"arguments" must be a JSON object', raw=raw)
    return FunctionCall(name=obj["name"], arguments=args, id=call_id, raw=raw)


__all__ = ["HermesToolParser"]
