"""Tools for multi-turn agent loops.

* :class:`BaseTool` — ``create`` / ``execute`` / ``release`` per trajectory instance, an OpenAI
  function schema (passed to the chat template's ``tools`` argument);
* :class:`FunctionTool` — a tool from a plain (sync or async) function, schema from its signature;
* :class:`ToolSession` — what the tool agent uses to run one turn's calls (timeouts, errors as
  text, truncation, bounded concurrency);
* :func:`load_tools` — tools from a YAML file of import paths or from Python objects.

To add a tool: write a function (``FunctionTool(fn)``), or subclass ``BaseTool`` when it keeps
per-trajectory state, and pass it to ``AgentLoopManager.create(..., tools=[...])`` or list it in
``agent.multi_turn.tool_config_path``.
"""

from rollfleet.agent_loop.tools.base import BaseTool, ToolResult, ToolReturn, to_tool_result
from rollfleet.agent_loop.tools.function_tool import FunctionTool, as_tool, function_schema, type_schema
from rollfleet.agent_loop.tools.loader import ToolsLike, load_tool_config, load_tools
from rollfleet.agent_loop.tools.runner import TRUNCATION_MARK, ToolOutcome, ToolSession, truncate

__all__ = [
    "BaseTool",
    "ToolResult",
    "ToolReturn",
    "to_tool_result",
    "FunctionTool",
    "as_tool",
    "function_schema",
    "type_schema",
    "load_tools",
    "ToolsLike",
    "load_tool_config",
    "ToolSession",
    "ToolOutcome",
    "truncate",
    "TRUNCATION_MARK",
]
