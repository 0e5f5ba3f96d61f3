"""The reward contract: a verifiable reward is a plain function of the response text.

``fn(solution_str, ground_truth, **kwargs) -> float | dict``. A dict must hold ``"score"``; its
other keys travel to the trainer as per-sample reward info (as verl's ``compute_score`` does).
Functions are pure and synchronous on purpose: they run in the agent-loop worker right after a
trajectory ends, so a reward that needs I/O (a judge model) belongs in an agent loop instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

RewardValue = Union[float, int, bool, dict[str, Any]]
RewardFn = Callable[..., RewardValue]


@dataclass(slots=True)
class RewardResult:
    """A computed reward: the scalar the trainer uses plus anything else the function reported."""

    score: float
    info: dict[str, Any] = field(default_factory=dict)


def to_result(value: RewardValue) -> RewardResult:
    """Normalise a reward function's return value."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"a reward dict must hold 'score', got keys {sorted(value)}")
        info = {k: v for k, v in value.items() if k != "score"}
        return RewardResult(float(value["score"]), info)
    return RewardResult(float(value))


__all__ = ["RewardFn", "RewardValue", "RewardResult", "to_result"]
