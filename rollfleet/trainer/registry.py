"""Trainers by name: ``@register_trainer("name")`` and ``get_trainer_cls(name)``.

To add a mode: subclass :class:`rollfleet.trainer.base.Trainer`, implement ``sample`` (and the
hooks you need), decorate it with ``@register_trainer("my_mode")`` and set
``trainer.trainer_mode: my_mode``.
"""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T", bound=type)

TRAINER_REGISTRY: dict[str, type] = {}


def register_trainer(name: str) -> Callable[[T], T]:
    def deco(cls: T) -> T:
        from rollfleet.trainer.base import Trainer

        if not (isinstance(cls, type) and issubclass(cls, Trainer)):
            raise TypeError(f"register_trainer('{name}'): {cls!r} is not a subclass of Trainer")
        if name in TRAINER_REGISTRY and TRAINER_REGISTRY[name] is not cls:
            raise ValueError(f"trainer '{name}' is already registered as {TRAINER_REGISTRY[name].__qualname__}")
        TRAINER_REGISTRY[name] = cls
        cls.mode_name = name
        return cls

    return deco


def get_trainer_cls(name: str) -> type:
    import rollfleet.trainer.modes  # noqa: F401  (registers the built-in modes)

    try:
        return TRAINER_REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown trainer '{name}'; registered trainers: {sorted(TRAINER_REGISTRY)}") from None


__all__ = ["register_trainer", "get_trainer_cls", "TRAINER_REGISTRY"]
