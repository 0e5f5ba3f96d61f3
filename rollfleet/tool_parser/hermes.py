"""Hermes / Qwen2.5 / Qwen3 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

An opening tag without its closing tag is not a call: it is left in the content (half a call
cannot be run). Whoever knows why the text ended decides: the tool agent tells the model its
call was never closed (a budget cut ends the trajectory before it parses), the gateway returns
the text as content.
"""

from __future__ import annotations

import json
import re

from rollfleet.tool_parser.base import FunctionCall, ParsedResponse, ToolParser

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesToolParser(ToolParser):
    call_start = "<tool_call>"

    def parse(self, text: str) -> ParsedResponse:
        calls: list[FunctionCall] = []
        for i, match in enumerate(_CALL.finditer(text)):
            calls.append(_parse_one(match.group(1).strip(), f"call_{i}"))
        content = _CALL.sub("", text).strip()
        return ParsedResponse(content=content, tool_calls=calls)


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
