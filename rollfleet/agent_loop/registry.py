"""Agent-loop registry: loops by name, from ``@register`` or a YAML file of import paths.

verl stores ``{"_target_": fqdn}`` and instantiates through hydra per trajectory; here the registry
holds classes (or import paths resolved on first use) plus constructor kwargs, and the worker
instantiates once. The YAML format accepts verl's files unchanged::

    - name: my_agent
      _target_: my_pkg.loops.MyAgentLoop     # or ``class:`` / ``path:``
      some_option: 3                         # anything else: constructor kwargs
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import yaml

from rollfleet.agent_loop.base import AgentLoopBase


@dataclass
class LoopSpec:
    """A registered loop: its class (or import path, resolved lazily) and constructor kwargs."""

    target: Union[type[AgentLoopBase], str]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def resolve(self) -> type[AgentLoopBase]:
        if isinstance(self.target, str):
            cls = import_object(self.target)
            if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
                raise TypeError(f"'{self.target}' is not an AgentLoopBase subclass")
            self.target = cls
        return self.target


_REGISTRY: dict[str, LoopSpec] = {}


def import_object(path: str) -> Any:
    """``"pkg.mod.Name"`` or ``"pkg.mod:Name"`` -> the object."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"'{path}' is not an import path (expected 'pkg.module.Name' or 'pkg.module:Name')")
    return getattr(importlib.import_module(module), attr)


def register(name: str, **kwargs: Any) -> Callable[[type[AgentLoopBase]], type[AgentLoopBase]]:
    """Class decorator: make a loop available as ``agent_name=name`` (kwargs go to its constructor)."""

    def deco(cls: type[AgentLoopBase]) -> type[AgentLoopBase]:
        if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
            raise TypeError(f"@register('{name}') needs an AgentLoopBase subclass, got {cls!r}")
        _REGISTRY[name] = LoopSpec(cls, dict(kwargs))
        return cls

    return deco


def list_agent_loops() -> list[str]:
    return sorted(_REGISTRY)


def get_agent_loop(name: str) -> LoopSpec:
    """The spec registered as ``name``; an error listing the valid names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown agent loop '{name}'; registered agent loops: {list_agent_loops()}") from None


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
        _REGISTRY[name] = LoopSpec(str(target), entry)
        names.append(name)
    return names


__all__ = ["LoopSpec", "register", "get_agent_loop", "list_agent_loops", "load_agent_loop_config", "import_object"]
