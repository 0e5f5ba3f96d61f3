"""The tool-call parser contract: model text in, function calls out.

A parser only reads text; it never evaluates it (JSON is parsed with ``json.loads``, nothing is
``eval``-ed). A call that is present but malformed is returned as a :class:`FunctionCall` with
``error`` set rather than dropped, so the loop can tell the model what was wrong (verl drops it
silently, and the trajectory then ends as if the model had not tried to call a tool).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional


@dataclass
class FunctionCall:
    """One tool call: ``name`` and JSON ``arguments``, or ``error`` when it could not be parsed."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    error: Optional[str] = None
    raw: str = ""

    def as_message_call(self) -> dict[str, Any]:
        """The OpenAI-style ``tool_calls`` entry of an assistant message."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedResponse:
    """A model turn split into its plain-text content and its tool calls."""

    content: str
    tool_calls: list[FunctionCall] = field(default_factory=list)


class ToolParser(ABC):
    """Extracts tool calls from one assistant turn's decoded text."""

    #: The text that opens a call in this format, if it has one: a reply streamed as it is
    #: sampled shows its text up to there, and its calls parsed when it ends.
    call_start: ClassVar[Optional[str]] = None

    @abstractmethod
    def parse(self, text: str) -> ParsedResponse: ...


__all__ = ["FunctionCall", "ParsedResponse", "ToolParser"]
