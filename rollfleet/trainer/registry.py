"""Trainers by name: ``@register_trainer("name")`` and ``get_trainer_cls(name)``.

To add a mode: subclass :class:`rollfleet.trainer.base.Trainer`, implement ``sample`` (and the
hooks you need), decorate it with ``@register_trainer("my_mode")`` (or call
``register_trainer("my_mode", "pkg.module:MyTrainer")`` to have it imported on first use) and set
``trainer.trainer_mode: my_mode``. The built-in modes are registered here by import path, so
``trainer.trainer_mode`` is checked when the config loads without importing any mode (nor torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, Union

from rollfleet.registry import Registry

if TYPE_CHECKING:  # for annotations only: importing the base class pulls in torch
    from rollfleet.trainer.base import Trainer

T = TypeVar("T", bound="type[Trainer]")

#: name -> trainer class; a :class:`rollfleet.registry.Registry` (``"sync" in TRAINER_REGISTRY``,
#: ``TRAINER_REGISTRY["sync"]`` and ``.names()`` work; lookups import lazily registered modes).
TRAINER_REGISTRY: Registry[type[Trainer]] = Registry(
    "trainer",
    kind="rollfleet.trainer.base:Trainer",
    builtins={
        "sync": "rollfleet.trainer.modes.sync:SyncTrainer",
        "colocate_async": "rollfleet.trainer.modes.colocate_async:ColocateAsyncTrainer",
        "separate_async": "rollfleet.trainer.modes.separate_async:SeparateAsyncTrainer",
    },
)


def register_trainer(name: str, target: Optional[Union[type[Trainer], str]] = None) -> Callable[[T], T] | Any:
    """Decorator registering a :class:`Trainer` subclass as mode ``name`` (sets its ``mode_name``);
    with ``target`` (a class or ``"pkg.module:Class"``), registers it directly."""
    if target is not None:
        return TRAINER_REGISTRY.register(name, target)

    def deco(cls: T) -> T:
        TRAINER_REGISTRY.register(name, cls)
        cls.mode_name = name
        return cls

    return deco


def get_trainer_cls(name: str) -> type[Trainer]:
    """The trainer registered as ``name``; ``UnknownName`` (a ``ValueError``) lists the valid ones."""
    cls = TRAINER_REGISTRY.get(name)
    if cls.__dict__.get("mode_name") is None:  # registered by path, without the decorator
        cls.mode_name = name
    return cls


__all__ = ["register_trainer", "get_trainer_cls", "TRAINER_REGISTRY"]
