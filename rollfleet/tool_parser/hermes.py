"""Hermes / Qwen2.5 / Qwen3 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

An opening tag without its closing tag is not a call: it is left in the content (half a call
cannot be run). Whoever knows why the text ended decides: the tool agent tells the model its
call was never closed (a budget cut ends the trajectory before it parses), the gateway returns
the text as content.
"""

from __future__ import annotations

import json

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
    """``(start, end, body)`` of every closed call. A body ends at the first closing tag after
    which it is JSON; at the first closing tag when none makes it JSON. A call whose arguments
    quote the tag (code that prints ``</tool_call>``) used to end inside its own string: a valid
    call answered as invalid JSON, the rest of it left in the content."""
    out = []
    pos = 0
    while (start := text.find(_OPEN, pos)) >= 0:
        body = start + len(_OPEN)
        first = close = text.find(_CLOSE, body)
        if first < 0:
            break  # not closed: left in the content (see the module docstring)
        while close >= 0 and not _is_json(text[body:close]):
            close = text.find(_CLOSE, close + len(_CLOSE))
        close = first if close < 0 else close
        out.append((start, close + len(_CLOSE), text[body:close]))
        pos = close + len(_CLOSE)
    return out


def _is_json(raw: str) -> bool:
    try:
        json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


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
