"""RL algorithm pieces of the learner: advantage estimators (by name) and policy losses.

Built-in advantage estimators: ``grpo`` (group-normalised; option ``norm_adv_by_std=False`` gives
Dr. GRPO), ``drgrpo`` (the same without the std division), ``rloo`` (REINFORCE, leave-one-out
baseline). To add one: write ``fn(scores [B], uids, response_mask [B, R], **options) -> [B, R]``
in a module of its own (see :mod:`.advantages` for the contract) and call
``register_advantage_estimator("name", fn)``; ``LearnerConfig.adv_estimator`` can then name it and
``LearnerConfig.adv_options`` pass its keyword options (checked against its signature at config
construction). The registry is a :class:`rollfleet.registry.Registry` (built-ins registered by
import path): an unknown name raises ``UnknownName`` (a ``ValueError``) listing the valid ones.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from rollfleet.trainer.advantage_registry import (
    ADVANTAGE_ESTIMATORS,
    available_advantage_estimators,
    check_advantage_options,
    get_advantage_estimator,
    register_advantage_estimator,
)
from rollfleet.trainer.algos.advantages import (
    AdvantageEstimator,
    drgrpo_advantages,
    group_index,
    grpo_advantages,
    rloo_advantages,
)
from rollfleet.trainer.algos.losses import (
    KLEstimator,
    LossAggMode,
    PolicyLossConfig,
    PolicyLossOutput,
    aggregate_loss,
    behaviour_importance_weight,
    clipped_surrogate,
    compute_policy_loss,
    entropy_from_logits,
    kl_penalty,
    masked_max,
    masked_mean,
)


def compute_advantages(
    name: str, scores: torch.Tensor, uids: Sequence[Hashable], response_mask: torch.Tensor, **options: Any
) -> torch.Tensor:
    """Run estimator ``name``: ``scores [B]`` + group ``uids`` -> advantages ``[B, R]`` on the response mask."""
    return get_advantage_estimator(name)(scores, uids, response_mask, **options)


__all__ = [
    "AdvantageEstimator",
    "ADVANTAGE_ESTIMATORS",
    "register_advantage_estimator",
    "get_advantage_estimator",
    "available_advantage_estimators",
    "check_advantage_options",
    "compute_advantages",
    "group_index",
    "grpo_advantages",
    "drgrpo_advantages",
    "rloo_advantages",
    "LossAggMode",
    "KLEstimator",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "masked_mean",
    "masked_max",
    "aggregate_loss",
    "clipped_surrogate",
    "behaviour_importance_weight",
    "kl_penalty",
    "entropy_from_logits",
    "compute_policy_loss",
]
