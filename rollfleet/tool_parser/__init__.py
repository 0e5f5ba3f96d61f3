"""Tool-call parsers, keyed by ``agent.multi_turn.format``.

Built in: ``hermes`` (aliases ``qwen``, ``qwen2_5``, ``qwen3``), registered by import path. To add
a format, subclass :class:`ToolParser` in a new module and register it::

    @register_tool_parser("my_format")
    class MyParser(ToolParser):
        def parse(self, text: str) -> ParsedResponse: ...

An unknown format raises ``UnknownName`` (a ``KeyError``) listing the valid ones.
"""

from __future__ import annotations

from typing import Callable

from rollfleet.registry import Registry
from rollfleet.tool_parser.base import FunctionCall, ParsedResponse, ToolParser
from rollfleet.tool_parser.hermes import HermesToolParser

_HERMES = "rollfleet.tool_parser.hermes:HermesToolParser"

TOOL_PARSERS: Registry[type[ToolParser]] = Registry(
    "tool-call format",
    kind=ToolParser,
    builtins={"hermes": _HERMES, "qwen": _HERMES, "qwen2_5": _HERMES, "qwen3": _HERMES},
)


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: make a :class:`ToolParser` subclass the parser of format ``name``."""
    return TOOL_PARSERS.register(name)


def list_tool_parsers() -> list[str]:
    return TOOL_PARSERS.names()


def get_tool_parser(name: str) -> ToolParser:
    """A parser instance for format ``name``; ``UnknownName`` listing the valid formats otherwise."""
    return TOOL_PARSERS.get(name)()


__all__ = [
    "FunctionCall",
    "ParsedResponse",
    "ToolParser",
    "HermesToolParser",
    "TOOL_PARSERS",
    "register_tool_parser",
    "get_tool_parser",
    "list_tool_parsers",
]
