"""Tool-call parsers, keyed by ``agent.multi_turn.format``.

Built in: ``hermes`` (aliases ``qwen``, ``qwen2_5``, ``qwen3``). To add a format, subclass
:class:`ToolParser` in a new module and register it::

    @register_tool_parser("my_format")
    class MyParser(ToolParser):
        def parse(self, text: str) -> ParsedResponse: ...
"""

from __future__ import annotations

from typing import Callable

from rollfleet.agent_loop.tool_parser.base import FunctionCall, ParsedResponse, ToolParser
from rollfleet.agent_loop.tool_parser.hermes import HermesToolParser

_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def deco(cls: type[ToolParser]) -> type[ToolParser]:
        _PARSERS[name] = cls
        return cls

    return deco


def list_tool_parsers() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    """A parser instance for format ``name``; an error listing the valid formats otherwise."""
    try:
        return _PARSERS[name]()
    except KeyError:
        raise KeyError(f"unknown tool-call format '{name}'; valid formats: {list_tool_parsers()}") from None


for _name in ("hermes", "qwen", "qwen2_5", "qwen3"):
    register_tool_parser(_name)(HermesToolParser)

__all__ = [
    "FunctionCall",
    "ParsedResponse",
    "ToolParser",
    "HermesToolParser",
    "register_tool_parser",
    "get_tool_parser",
    "list_tool_parsers",
]
