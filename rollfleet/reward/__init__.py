"""Verifiable rewards, computed where a trajectory finishes (in the agent-loop worker).

A sample names its reward in its ``reward`` spec: ``{"name": "numeric_match", "ground_truth": "42",
**kwargs}`` (``name`` defaults to ``agent.default_reward``). :func:`compute_reward` looks the
function up here and calls ``fn(solution_str, ground_truth, **kwargs)``.

Built in: ``exact_match``, ``numeric_match`` (alias ``math``), ``format``. To add one::

    from rollfleet.reward import register_reward

    @register_reward("my_reward")
    def my_reward(solution_str: str, ground_truth, **kwargs) -> float: ...

The module defining it must be imported in the worker process (import it from the module that
defines your agent loop or tools, or name it by import path: ``{"name": "pkg.mod:fn"}``).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Optional

from rollfleet.reward.answers import extract_answer, extract_boxed, extract_gsm8k, extract_last_number, parse_number
from rollfleet.reward.base import RewardFn, RewardResult, RewardValue, to_result
from rollfleet.reward.rules import answer_format, exact_match, numeric_match

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn`` under ``name`` (a second registration of a name replaces it)."""

    def deco(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = fn
        return fn

    return deco


def list_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward_fn(name: str) -> RewardFn:
    """The reward registered as ``name``, or ``"pkg.module:function"`` imported; a clear error
    listing the registered names otherwise."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr)
    raise KeyError(f"unknown reward '{name}'; registered rewards: {list_rewards()} (or use 'pkg.module:function')")


def compute_reward(
    solution_str: str, spec: Optional[Mapping[str, Any]], default: Optional[str] = None
) -> Optional[RewardResult]:
    """Score ``solution_str`` by the sample's reward ``spec``; None when the sample asks for none."""
    if not spec:
        return None
    kwargs = dict(spec)
    name = kwargs.pop("name", None) or default
    if name is None:
        return None
    ground_truth = kwargs.pop("ground_truth", None)
    return to_result(get_reward_fn(name)(solution_str, ground_truth, **kwargs))


register_reward("exact_match")(exact_match)
register_reward("numeric_match")(numeric_match)
register_reward("math")(numeric_match)
register_reward("format")(answer_format)

__all__ = [
    "RewardFn",
    "RewardValue",
    "RewardResult",
    "register_reward",
    "get_reward_fn",
    "list_rewards",
    "compute_reward",
    "exact_match",
    "numeric_match",
    "answer_format",
    "extract_answer",
    "extract_boxed",
    "extract_gsm8k",
    "extract_last_number",
    "parse_number",
]
