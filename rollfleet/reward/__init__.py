"""Verifiable rewards, computed where a trajectory finishes (in the agent-loop worker).

A sample names its reward in its ``reward`` spec: ``{"name": "numeric_match", "ground_truth": "42",
**kwargs}`` (``name`` defaults to ``agent.default_reward``). :func:`compute_reward` looks the
function up here and calls ``fn(solution_str, ground_truth, **kwargs)``.

Built in: ``exact_match``, ``numeric_match`` (alias ``math``), ``format``. To add one::

    from rollfleet.reward import register_reward

    @register_reward("my_reward")
    def my_reward(solution_str: str, ground_truth, **kwargs) -> float: ...

The module defining it must be imported in the worker process (import it from the module that
defines your agent loop or tools, or name it by import path: ``{"name": "pkg.mod:fn"}``). Names are
unique: registering a name again with another function raises ``AlreadyRegistered``; an unknown
name raises ``UnknownName`` (a ``KeyError``) listing the registered ones.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from rollfleet.errors import InvalidPlugin
from rollfleet.registry import Registry, resolve
from rollfleet.reward.answers import extract_answer, extract_boxed, extract_gsm8k, extract_last_number, parse_number
from rollfleet.reward.base import RewardFn, RewardResult, RewardValue, to_result
from rollfleet.reward.rules import answer_format, exact_match, numeric_match

REWARDS: Registry[RewardFn] = Registry(
    "reward",
    callable_only=True,
    hint="or use 'pkg.module:function'",
    builtins={
        "exact_match": "rollfleet.reward.rules:exact_match",
        "numeric_match": "rollfleet.reward.rules:numeric_match",
        "math": "rollfleet.reward.rules:numeric_match",
        "format": "rollfleet.reward.rules:answer_format",
    },
)


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn`` as ``name`` (names are unique; the same function again is a no-op)."""
    return REWARDS.register(name)


def list_rewards() -> list[str]:
    return REWARDS.names()


def get_reward_fn(name: str) -> RewardFn:
    """The reward registered as ``name``, or ``"pkg.module:function"`` imported; ``UnknownName``
    listing the registered names otherwise."""
    if name not in REWARDS and ":" in name:
        fn = resolve(name)
        if not callable(fn):
            raise InvalidPlugin("reward", name, f"'{name}'", "callable")
        return fn
    return REWARDS.get(name)


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


__all__ = [
    "RewardFn",
    "RewardValue",
    "RewardResult",
    "REWARDS",
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
