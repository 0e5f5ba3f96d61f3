"""``FunctionTool``: a tool from a plain Python function (sync or async).

The JSON schema comes from the signature and type hints; the description from the docstring's
first paragraph and parameter descriptions from a Google-style ``Args:`` section. A sync function
runs on a thread of its own so a slow one neither blocks the worker's event loop nor escapes the
timeout (the thread itself cannot be killed: on timeout it finishes in the background, its result
dropped), and a hung one holds up no other call.

Arguments are bound with ``inspect.Signature.bind``: a missing or unexpected argument is a tool
error the model gets to read, not a crash.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import inspect
import json
import re
import types
import typing
from typing import Any, Callable, Optional

from rollfleet.agent_loop.tools.base import BaseTool, ToolResult
from rollfleet.utils.aio import ThreadPerCall

#: Sync tools run each on a thread of its own: a hung one keeps only its own (see ThreadPerCall).
_THREADS = ThreadPerCall()

_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def type_schema(tp: Any) -> dict[str, Any]:
    """JSON schema of a Python type hint (the common cases; anything else is unconstrained)."""
    if tp is inspect.Parameter.empty or tp is Any:
        return {}
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return type_schema(rest[0])
        return {"anyOf": [type_schema(a) for a in rest]}
    if origin is typing.Literal:
        schema: dict[str, Any] = {"enum": list(args)}
        kinds = {_SIMPLE.get(type(a)) for a in args}
        if len(kinds) == 1 and None not in kinds:
            schema["type"] = kinds.pop()
        return schema
    if origin in (list, tuple, set, frozenset) or tp in (list, tuple, set, frozenset):
        schema = {"type": "array"}
        if args and args[0] is not Ellipsis:
            schema["items"] = type_schema(args[0])
        return schema
    if origin is dict or tp is dict:
        return {"type": "object"}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [m.value for m in tp]}
    if isinstance(tp, type) and hasattr(tp, "model_json_schema"):  # a pydantic model
        return tp.model_json_schema()
    if tp in _SIMPLE:
        return {"type": _SIMPLE[tp]}
    return {}


def parse_docstring(doc: Optional[str]) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google-style docstring."""
    if not doc:
        return "", {}
    doc = inspect.cleandoc(doc)
    parts = re.split(r"\n\s*\n", doc, maxsplit=1)
    description = " ".join(parts[0].split())
    params: dict[str, str] = {}
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, flags=re.MULTILINE)
    if section:
        current = None
        for line in section.group(1).splitlines():
            m = re.match(r"^\s+(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if m:
                current = m.group(1).lstrip("*")
                params[current] = m.group(2).strip()
            elif current and line.strip():
                params[current] = (params[current] + " " + line.strip()).strip()
    return description, params


def function_schema(fn: Callable[..., Any], name: Optional[str] = None, description: Optional[str] = None) -> dict:
    """The OpenAI function schema of ``fn``."""
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable forward references: fall back to raw annotations
        hints = {}
    doc_description, doc_params = parse_docstring(inspect.getdoc(fn))
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in sig.parameters.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        prop = type_schema(hints.get(pname, param.annotation))
        if pname in doc_params:
            prop["description"] = doc_params[pname]
        if param.default is inspect.Parameter.empty:
            required.append(pname)
        elif _jsonable(param.default):
            prop["default"] = param.default
        properties[pname] = prop
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return {
        "type": "function",
        "function": {
            "name": name or fn.__name__,
            "description": description if description is not None else doc_description,
            "parameters": parameters,
        },
    }


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.dumps(value, ensure_ascii=False, default=str)


class FunctionTool(BaseTool):
    """Wrap ``fn`` as a stateless tool (instances are no-ops). Return a :class:`ToolResult` from
    ``fn`` to report a reward; anything else is sent to the model as text (JSON if not a str)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: Optional[str] = None,
        description: Optional[str] = None,
        tool_schema: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__(tool_schema or function_schema(fn, name, description))
        self.fn = fn
        try:
            self.signature: Optional[inspect.Signature] = inspect.signature(fn)
        except ValueError:  # a builtin without one (math.hypot): its YAML tool_schema describes it
            if tool_schema is None:
                raise
            self.signature = None
        # an object whose __call__ is async is a coroutine function too (iscoroutinefunction says no)
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
        params = self.signature.parameters.values() if self.signature is not None else ()
        self._positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY]

    def _arguments(self, parameters: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """The model names every argument: positional-only ones (math.sqrt's x) go by position, a
        gap before the last one given taking its default (it shifted the next one into its place).
        A TypeError (missing, unexpected) is reported to the model."""
        given = [i for i, p in enumerate(self._positional) if p.name in parameters]
        args = []
        for p in self._positional[: given[-1] + 1] if given else ():
            if p.name in parameters:
                args.append(parameters[p.name])
            elif p.default is not inspect.Parameter.empty:
                args.append(p.default)
            else:
                raise TypeError(f"missing a required argument: '{p.name}'")
        names = {p.name for p in self._positional}
        rest = {k: v for k, v in parameters.items() if k not in names}
        if self.signature is None:  # a builtin that takes no keywords (math.hypot): by position, in the schema's order
            order = list((self.tool_schema.get("function", {}).get("parameters") or {}).get("properties") or {})
            unknown = sorted(set(parameters) - set(order))
            if unknown:
                raise TypeError(f"unexpected argument(s) {unknown}; the tool takes {order}")
            return [parameters[k] for k in order if k in parameters], {}
        bound = self.signature.bind(*args, **rest)
        return list(bound.args), dict(bound.kwargs)

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResult | str:
        args, kwargs = self._arguments(parameters)
        if self.is_async:
            value = await self.fn(*args, **kwargs)
        else:
            call = functools.partial(self.fn, *args, **kwargs)
            value = await asyncio.get_running_loop().run_in_executor(_THREADS, call)
        if inspect.isawaitable(value):  # a sync wrapper that returns a coroutine: its result, not its repr
            value = await value
        return value if isinstance(value, ToolResult) else _to_text(value)


def as_tool(obj: Any) -> BaseTool:
    """A ``BaseTool`` as is; a plain callable wrapped in :class:`FunctionTool`."""
    if isinstance(obj, BaseTool):
        return obj
    if callable(obj):
        return FunctionTool(obj)
    raise TypeError(f"not a tool: {obj!r} (need a BaseTool or a function)")


__all__ = ["FunctionTool", "function_schema", "type_schema", "parse_docstring", "as_tool"]
