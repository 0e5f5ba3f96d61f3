"""Agent-loop registry: loops by name, from ``@register`` or a YAML file of import paths.

verl stores ``{"_target_": fqdn}`` and instantiates through hydra per trajectory; here the registry
(a :class:`rollfleet.registry.Registry`) holds classes, or import paths resolved on first use, with
their constructor kwargs as the entry's options, and the worker instantiates once. The built-in
loops are registered by path. The YAML format accepts verl's files unchanged::

    - name: my_agent
      _target_: my_pkg.loops.MyAgentLoop     # or ``class:`` / ``path:``
      some_option: 3                         # anything else: constructor kwargs

Loading the same file twice is fine; naming a registered loop with another class or other kwargs
raises ``AlreadyRegistered``, and an unknown name ``UnknownName`` (a ``KeyError``) listing the
valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import yaml

from rollfleet.agent_loop.base import AgentLoopBase
from rollfleet.registry import Registry, resolve

#: Kept for callers of the old name: the one import-path resolver is :func:`rollfleet.registry.resolve`.
import_object = resolve

AGENT_LOOPS: Registry[type[AgentLoopBase]] = Registry(
    "agent loop",
    kind=AgentLoopBase,
    builtins={
        "single_turn_agent": "rollfleet.agent_loop.single_turn:SingleTurnAgentLoop",
        "tool_agent": "rollfleet.agent_loop.tool_agent:ToolAgentLoop",
    },
)


@dataclass
class LoopSpec:
    """A registered loop: its name, its class (or import path until first use) and constructor kwargs."""

    name: str
    target: Union[type[AgentLoopBase], str]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def resolve(self) -> type[AgentLoopBase]:
        """The loop's class, imported now if registered by path (``InvalidPlugin`` if it is not a loop)."""
        self.target = AGENT_LOOPS.get(self.name)
        return self.target


def register(name: str, **kwargs: Any) -> Callable[[type[AgentLoopBase]], type[AgentLoopBase]]:
    """Class decorator: make a loop available as ``agent_name=name`` (kwargs go to its constructor)."""
    return AGENT_LOOPS.register(name, options=kwargs)


def list_agent_loops() -> list[str]:
    return AGENT_LOOPS.names()


def get_agent_loop(name: str) -> LoopSpec:
    """The spec registered as ``name`` (nothing imported yet); ``UnknownName`` listing the valid names otherwise."""
    entry = AGENT_LOOPS.entry(name)
    return LoopSpec(name, entry.target, dict(entry.options))


def load_agent_loop_config(path: Optional[str]) -> list[str]:
    """Register the loops named in a YAML file (a list, or a mapping of name -> entry); returns
    their names. Classes are imported on first use, so a typo fails when that loop is used."""
    if not path:
        return []
    with open(path) as f:
        data = yaml.safe_load(f) or []
    entries: list[dict[str, Any]]
    if isinstance(data, dict):
        entries = [{"name": k, **(v if isinstance(v, dict) else {"_target_": v})} for k, v in data.items()]
    else:
        entries = list(data)
    names = []
    for entry in entries:
        entry = dict(entry)
        name = entry.pop("name", None)
        target = entry.pop("_target_", None) or entry.pop("class", None) or entry.pop("path", None)
        if not name or not target:
            raise ValueError(f"{path}: every agent loop needs 'name' and '_target_' (got {entry})")
        AGENT_LOOPS.register(name, str(target), options=entry)
        names.append(name)
    return names


__all__ = [
    "AGENT_LOOPS",
    "LoopSpec",
    "register",
    "get_agent_loop",
    "list_agent_loops",
    "load_agent_loop_config",
    "import_object",
]
