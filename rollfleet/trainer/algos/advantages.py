"""Advantage estimators: sequence scores in, per-token advantages out.

Every estimator here is *critic-free*: it turns one scalar score per sequence into one advantage per
sequence by comparing the sequence with the others sampled for the same prompt (its group, named
by ``uid``), then broadcasts that value to the sequence's response tokens. That is why the input is
``scores [B]`` plus ``uids`` and the output is ``[B, R]`` masked by ``response_mask``: the loss works
per token, the reward is per sequence.

Statistics are computed in float64 and returned in float32, so a hand-computed expectation matches
to float32 precision. The group standard deviation is the unbiased one (Bessel's correction), as in
verl's GRPO, so numbers are comparable with verl runs.

Trade-off: a group of one sequence gets advantage 0 (there is nothing to compare it with). verl
instead gives it its raw score (mean 0, std 1); we prefer "no signal" over an unbaselined one,
at the cost that ``n=1`` sampling trains nothing with these estimators.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import numpy as np
import torch


class AdvantageEstimator(Protocol):
    """``(scores [B], uids, response_mask [B, R], **options) -> advantages [B, R]``."""

    def __call__(
        self, scores: torch.Tensor, uids: Sequence[Hashable], response_mask: torch.Tensor, **options: Any
    ) -> torch.Tensor: ...


def group_index(uids: Sequence[Hashable] | torch.Tensor | np.ndarray) -> torch.Tensor:
    """Map group ids (any hashables, or a tensor/array of them) to dense ints ``0..G-1``, in order
    of first appearance."""
    if isinstance(uids, (torch.Tensor, np.ndarray)):
        uids = uids.tolist()
    dense: dict[Hashable, int] = {}
    return torch.tensor([dense.setdefault(uid, len(dense)) for uid in uids], dtype=torch.long)


def _check(scores: torch.Tensor, uids: Sequence[Hashable], response_mask: torch.Tensor) -> torch.Tensor:
    if scores.ndim != 1:
        raise ValueError(f"scores must have shape [B], got {tuple(scores.shape)}")
    if response_mask.ndim != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"response_mask must have shape [B, R] with B={scores.shape[0]}, got {tuple(response_mask.shape)}"
        )
    if len(uids) != scores.shape[0]:
        raise ValueError(f"uids must have one entry per score ({scores.shape[0]}), got {len(uids)}")
    return group_index(uids).to(scores.device)


def _group_stats(scores: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (group mean, group unbiased std, group size), float64."""
    s = scores.detach().to(torch.float64)
    num_groups = int(groups.max().item()) + 1 if groups.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float64, device=s.device).index_add_(0, groups, torch.ones_like(s))
    total = torch.zeros_like(count).index_add_(0, groups, s)
    mean = (total / count)[groups]
    sq = torch.zeros_like(count).index_add_(0, groups, (s - mean) ** 2)
    var = sq / (count - 1).clamp(min=1)
    return mean, var.sqrt()[groups], count[groups]


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return per_seq.to(torch.float32).unsqueeze(-1) * response_mask.to(torch.float32)


def grpo_advantages(
    scores: torch.Tensor,
    uids: Sequence[Hashable],
    response_mask: torch.Tensor,
    *,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO: ``(r - mean_g) / (std_g + eps)`` per group ``g``; with ``norm_adv_by_std=False`` only
    ``r - mean_g`` (Dr. GRPO, which removes the bias towards groups with low reward variance).
    A group whose rewards are all equal gets 0. Returns float32 ``[B, R]``, zero on padding."""
    groups = _check(scores, uids, response_mask)
    mean, std, count = _group_stats(scores, groups)
    adv = scores.detach().to(torch.float64) - mean
    if norm_adv_by_std:
        adv = adv / (std + eps)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    return _broadcast(adv, response_mask)


def drgrpo_advantages(scores: torch.Tensor, uids: Sequence[Hashable], response_mask: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: GRPO without the division by the group std."""
    return grpo_advantages(scores, uids, response_mask, norm_adv_by_std=False)


def rloo_advantages(scores: torch.Tensor, uids: Sequence[Hashable], response_mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE with a leave-one-out baseline: ``r_i - mean_{j != i in g} r_j``
    (= ``n/(n-1) * (r_i - mean_g)``); unbiased, unlike a baseline that includes ``r_i`` itself."""
    groups = _check(scores, uids, response_mask)
    mean, _, count = _group_stats(scores, groups)
    adv = (scores.detach().to(torch.float64) - mean) * count / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    return _broadcast(adv, response_mask)


__all__ = ["AdvantageEstimator", "group_index", "grpo_advantages", "drgrpo_advantages", "rloo_advantages"]
