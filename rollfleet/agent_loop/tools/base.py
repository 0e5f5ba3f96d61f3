"""The tool contract: ``create`` / ``execute`` / ``release`` per trajectory instance.

One tool object serves every trajectory of a worker concurrently; ``instance_id`` (one per
trajectory and tool) keys whatever per-trajectory state a tool keeps (a sandbox, a database
connection, a game). The agent loop creates an instance on a trajectory's first call of the tool
and releases it when the trajectory ends, whatever happened.

``execute`` returns the text the model will see, or ``(text, reward, metrics)`` /
:class:`ToolResult` when the tool also scores the call (tool rewards end up in the trajectory's
``extra_fields["tool_rewards"]``). An exception or a timeout does not end the trajectory: the loop
turns it into a tool message so the model sees the failure, as a real agent would.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class ToolResult:
    """A tool's answer: text for the model, an optional reward and metrics for the trainer."""

    text: str
    reward: Optional[float] = None
    metrics: dict[str, Any] = field(default_factory=dict)


ToolReturn = Union[str, ToolResult, tuple]


def to_tool_result(value: ToolReturn) -> ToolResult:
    """Normalise what ``execute`` returned."""
    if isinstance(value, ToolResult):
        return value
    if isinstance(value, str):
        return ToolResult(value)
    if isinstance(value, tuple) and 1 <= len(value) <= 3:
        text = value[0] if isinstance(value[0], str) else str(value[0])
        reward = value[1] if len(value) > 1 else None
        metrics = value[2] if len(value) > 2 and isinstance(value[2], dict) else {}
        return ToolResult(text, None if reward is None else float(reward), dict(metrics))
    raise TypeError(f"a tool must return str, ToolResult or (text, reward, metrics), got {type(value).__name__}")


class BaseTool(ABC):
    """Base of every tool. ``tool_schema`` is the OpenAI function schema handed to the chat template.

    Args:
        tool_schema: ``{"type": "function", "function": {"name", "description", "parameters"}}``.
        config: tool-specific settings (from the tools YAML).
    """

    def __init__(self, tool_schema: dict[str, Any], config: Optional[dict[str, Any]] = None) -> None:
        function = tool_schema.get("function", tool_schema)
        if not function.get("name"):
            raise ValueError("a tool schema needs function.name")
        self.tool_schema: dict[str, Any] = {"type": "function", "function": dict(function)}
        self.config: dict[str, Any] = dict(config or {})

    @property
    def name(self) -> str:
        return self.tool_schema["function"]["name"]

    async def create(self, instance_id: str, **kwargs: Any) -> str:
        """Set up per-trajectory state (``kwargs`` = the sample's ``tools_kwargs[name]["create_kwargs"]``)."""
        return instance_id

    @abstractmethod
    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolReturn:
        """Run one call with the model's ``parameters``."""

    async def release(self, instance_id: str) -> None:
        """Free per-trajectory state; called once per created instance, even after failures."""


__all__ = ["BaseTool", "ToolResult", "ToolReturn", "to_tool_result"]
