"""Advantage estimators by name (see :mod:`rollfleet.trainer.algos`), without importing them.

The learner config names an estimator and its options and is checked wherever a config loads, most
often in processes that never train. Built-ins are registered by import path, so a name is checked
without importing anything; the estimator (and torch with it) is imported only to check options
against its signature, or to run it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from rollfleet.registry import Registry

if TYPE_CHECKING:
    from rollfleet.trainer.algos.advantages import AdvantageEstimator

ADVANTAGE_ESTIMATORS: "Registry[AdvantageEstimator]" = Registry(
    "advantage estimator",
    callable_only=True,
    builtins={
        "grpo": "rollfleet.trainer.algos.advantages:grpo_advantages",
        "drgrpo": "rollfleet.trainer.algos.advantages:drgrpo_advantages",
        "rloo": "rollfleet.trainer.algos.advantages:rloo_advantages",
    },
)


def register_advantage_estimator(name: str, fn: "AdvantageEstimator | str") -> None:
    """Make ``fn`` (or its ``"pkg.module:function"`` path) available as ``name`` (names are unique)."""
    ADVANTAGE_ESTIMATORS.register(name, fn)


def get_advantage_estimator(name: str) -> "AdvantageEstimator":
    """The estimator registered as ``name``; ``UnknownName`` (a ``ValueError``) lists the valid ones."""
    return ADVANTAGE_ESTIMATORS.get(name)


def available_advantage_estimators() -> list[str]:
    return ADVANTAGE_ESTIMATORS.names()


def check_advantage_options(name: str, options: dict[str, Any]) -> None:
    """Raise ``ValueError`` if ``name`` is not registered or ``options`` are not keyword options of
    its estimator (so a typo fails when the config is built, not at the first update). With no
    options only the name is checked: nothing is imported."""
    if not options:
        ADVANTAGE_ESTIMATORS.check_name(name)
        return
    fn = get_advantage_estimator(name)
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    # the three inputs (scores, uids, response_mask) come first; anything after them that a
    # keyword can set is an option (a plain ``scale=1.0`` as much as a keyword-only one)
    keywords = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    valid = sorted(
        n for i, (n, p) in enumerate(params.items()) if p.kind in keywords and (i >= 3 or p.kind is keywords[0])
    )
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"advantage estimator '{name}' has no option(s) {unknown}; valid options: {valid}")


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "available_advantage_estimators",
    "check_advantage_options",
    "get_advantage_estimator",
    "register_advantage_estimator",
]
