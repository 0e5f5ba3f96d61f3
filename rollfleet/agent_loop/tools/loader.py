"""Tools from a YAML file (``agent.multi_turn.tool_config_path``) or from Python objects.

YAML (verl's ``tools:`` list is accepted as is)::

    tools:
      - class_name: my_pkg.tools.SandboxTool   # a BaseTool subclass
        config: {timeout: 5}
        tool_schema: {type: function, function: {name: run_code, ...}}
      - function: my_pkg.tools.calculator      # a plain function -> FunctionTool
        name: calc                             # optional rename
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import yaml

from rollfleet.agent_loop.tools.base import BaseTool
from rollfleet.agent_loop.tools.function_tool import FunctionTool, as_tool
from rollfleet.registry import resolve

ToolsLike = Union[None, str, Iterable[Any], dict[str, Any]]


def load_tool_config(path: str) -> list[BaseTool]:
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    entries = data.get("tools", []) if isinstance(data, dict) else data
    tools: list[BaseTool] = []
    for entry in entries:
        if "function" in entry and isinstance(entry["function"], str):
            unused = set(entry) - {"function", "name", "description", "tool_schema"}
            if unused:
                raise ValueError(f"{path}: a function tool entry takes function, name, description and tool_schema, "
                                 f"not {sorted(unused)}")  # fmt: skip
            beside = sorted({"name", "description"} & set(entry)) if entry.get("tool_schema") is not None else []
            if beside:  # one of the two would be dropped
                raise ValueError(f"{path}: with tool_schema, the tool's name and description come from the schema; "
                                 f"remove {beside}")  # fmt: skip
            tools.append(
                FunctionTool(
                    resolve(entry["function"]),
                    name=entry.get("name"),
                    description=entry.get("description"),
                    tool_schema=entry.get("tool_schema"),  # it was dropped: the tool went by the function's name
                )
            )
            continue
        target = entry.get("class_name") or entry.get("class") or entry.get("_target_")
        if not target:
            raise ValueError(f"{path}: a tool entry needs 'class_name' or 'function' (got {entry})")
        cls = resolve(target)
        if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
            raise TypeError(f"{path}: '{target}' is not a BaseTool subclass")
        schema = entry.get("tool_schema")
        # The subclass's own constructor: one without a schema in the YAML builds its own.
        make: Callable[..., BaseTool] = cls
        tools.append(
            make(schema, entry.get("config") or {}) if schema is not None else make(config=entry.get("config") or {})
        )
    return tools


def load_tools(tools: ToolsLike = None, tool_config_path: Optional[str] = None) -> dict[str, BaseTool]:
    """name -> tool from a YAML path and/or tools / functions (a duplicate name is an error)."""
    items: list[BaseTool] = []
    if tool_config_path:
        items.extend(load_tool_config(tool_config_path))
    if isinstance(tools, str):
        items.extend(load_tool_config(tools))
    elif isinstance(tools, dict):
        items.extend(as_tool(t) for t in tools.values())
    elif tools is not None:
        items.extend(as_tool(t) for t in tools)
    out: dict[str, BaseTool] = {}
    for tool in items:
        if tool.name in out:
            raise ValueError(f"two tools are named '{tool.name}'")
        out[tool.name] = tool
    return out


__all__ = ["load_tools", "load_tool_config", "ToolsLike"]
