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
    that closing tag (an unclosed one in the model's thinking or prose used to swallow the call),
    for a few of them; past :data:`_MAX_STRAY_TAGS`, the last one before the closing tag starts the
    call, so that the scan stays linear in the text."""
    out = []
    pos = 0
    while (start := text.find(_OPEN, pos)) >= 0:
        body = start + len(_OPEN)
        close = text.find(_CLOSE, body)
        if close < 0:
            break  # not closed: left in the content (see the module docstring)
        end = _json_end(text, body)
        hops = 0
        while end is None or not text.startswith(_CLOSE, end):
            # a stray opening tag (in thought, in prose) before a call: the next one may start it
            # (the next, not the last: the call's own JSON may quote the tag); past a few, the last
            inner = text.find(_OPEN, body, close)
            if inner < 0:
                break
            hops += 1
            if hops > _MAX_STRAY_TAGS:  # a run of them (one token each): each try costs the text
                inner = text.rfind(_OPEN, body, close)
            start, body = inner, inner + len(_OPEN)
            end = _json_end(text, body)
            if hops > _MAX_STRAY_TAGS:
                break
        if end is not None and end > close and text.startswith(_CLOSE, end):
            close = end
        out.append((start, close + len(_CLOSE), text[body:close]))
        pos = close + len(_CLOSE)
    return out


#: Stray opening tags tried one by one before the last one is taken (a failed decode costs its
#: position in the text: a reply of 32,000 repeated tags took 5.6 s tried one by one).
_MAX_STRAY_TAGS = 8
_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


def _json_end(text: str, at: int) -> Optional[int]:
    """Where the whitespace after the JSON value starting at ``at`` ends, or None if none starts."""
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    if not text.startswith("{", at):  # a call is an object: anything else fails without decoding
        return None
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
