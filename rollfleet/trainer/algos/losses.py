"""Policy losses: PPO clipped surrogate, decoupled PPO for stale samples, KL and entropy terms.

Three log-prob tensors meet here, all ``[B, R]`` over response tokens:

* ``log_probs``: the policy being optimised (has a gradient);
* ``old_log_probs``: the *proximal* policy, i.e. the learner's own log probs before this step's
  first update, computed once with no gradient. The trust region (the clip) is taken around it;
* ``rollout_log_probs``: the *behaviour* policy, i.e. what the inference engine reported while it
  sampled. With asynchronous rollouts it can be several weight versions stale, and even when fresh
  it differs from the learner's numbers (other kernels, other precision).

Decoupled PPO (AReaL, Fu et al. 2025) keeps the clip around the proximal policy, so one step never
moves far from the current weights however stale the data, and corrects for sampling from the
behaviour policy with the importance weight ``exp(old - rollout)``, a constant (no gradient) that
multiplies the clipped surrogate. The weight is capped: ``truncate`` clips it at the cap
(truncated importance sampling, biased but never dropping a token), ``mask`` zeroes tokens above it
(AReaL's choice: those tokens are too off-policy to learn from).

Aggregation is separate from the per-token loss so that gradient accumulation can divide by the
token (or sequence) count of the whole mini-batch, not of each micro-batch: passing ``num_tokens``
/ ``num_seqs`` of the mini-batch makes the sum over micro-batches equal the mini-batch loss.

Metrics are detached scalar tensors (no device sync here). Keys ending in ``_max`` are maxima;
every other key is a mean over the valid tokens of the call, to be weighted by its token count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from rollfleet.trainer.learner_config import KLEstimator, LossAggMode, PolicyLossConfig

#: Log-ratio clamp before ``exp``: keeps padded or wildly off-policy tokens finite (``exp(20)``).
LOG_RATIO_CLAMP = 20.0
#: verl clamps the k3 estimate to this range; a single token then cannot dominate the KL term.
LOW_VAR_KL_CLAMP = 10.0


@dataclass
class SurrogateTerms:
    """Per-token pieces of the clipped surrogate, all ``[B, R]``."""

    loss: torch.Tensor  # -A * clipped ratio, with dual clip where enabled (has grad)
    ratio: torch.Tensor  # exp(logp - old_logp) (has grad)
    clipped: torch.Tensor  # bool: the clip is the active branch
    dual_clipped: torch.Tensor  # bool: the dual clip is the active branch (A < 0 only)


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of ``values`` where ``mask`` is set (``-inf`` when the mask is empty)."""
    return torch.where(mask.bool(), values, torch.full_like(values, float("-inf"))).max()


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggMode = "token-mean",
    *,
    num_tokens: Optional[float | torch.Tensor] = None,
    num_seqs: Optional[float | torch.Tensor] = None,
) -> torch.Tensor:
    """Reduce a per-token ``[B, R]`` loss to a scalar.

    ``token-mean``: sum over all valid tokens / ``num_tokens`` (every token weighs the same, so long
    responses weigh more: DAPO). ``seq-mean-token-mean``: each sequence's token mean, averaged over
    ``num_seqs`` sequences. ``seq-mean-token-sum``: each sequence's token sum, averaged over
    sequences. ``seq-mean-token-sum-norm``: token sums divided by the constant ``R`` (Dr. GRPO).
    ``num_tokens`` / ``num_seqs`` default to this call's counts; pass the mini-batch's counts when
    accumulating gradients over micro-batches. Sequences with no valid token are not counted.
    """
    mask = mask.to(values.dtype)
    token_sum = values * mask
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return token_sum.sum() / _at_least_one(denom, values)
    seq_tokens = mask.sum(-1)
    if num_seqs is None:
        num_seqs = (seq_tokens > 0).sum()
    if mode == "seq-mean-token-sum":
        per_seq = token_sum.sum(-1)
    elif mode == "seq-mean-token-mean":
        per_seq = token_sum.sum(-1) / seq_tokens.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = token_sum.sum(-1) / values.shape[-1]
    else:
        raise ValueError(
            f"unknown loss_agg_mode '{mode}'; valid modes: "
            "['token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm']"
        )
    return per_seq.sum() / _at_least_one(num_seqs, values)


def _at_least_one(denom: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(denom, dtype=like.dtype, device=like.device).clamp(min=1)


def clipped_surrogate(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = None,
) -> SurrogateTerms:
    """PPO's pessimistic surrogate per token: ``max(-A*r, -A*clip(r, 1-lo, 1+hi))`` with
    ``r = exp(logp - old)``; with dual clip, for ``A < 0`` the loss is further bounded by
    ``-A*c`` so a huge ratio on a bad token cannot blow the update up."""
    log_ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_branch = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped_branch)
    clipped = clipped_branch > unclipped
    dual = torch.zeros_like(clipped)
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    # A dual-clipped token (A < 0, ratio > c > 1 + hi) never has the clip branch active: disjoint.
    return SurrogateTerms(loss=loss, ratio=ratio, clipped=clipped, dual_clipped=dual)


def behaviour_importance_weight(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    *,
    cap: float,
    mode: Literal["truncate", "mask"] = "truncate",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled-PPO weight ``exp(old - rollout)`` (proximal over behaviour policy), detached,
    capped at ``cap`` (``truncate``) or zeroed above it (``mask``). Returns ``(weight, capped)``,
    ``capped`` marking the tokens the cap changed."""
    log_w = (old_log_probs - rollout_log_probs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weight = torch.exp(log_w)
    capped = weight > cap
    if mode == "truncate":
        weight = weight.clamp(max=cap)
    elif mode == "mask":
        weight = torch.where(capped, torch.zeros_like(weight), weight)
    else:
        raise ValueError(f"unknown behav_imp_weight_mode '{mode}'; valid modes: ['mask', 'truncate']")
    return weight, capped


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: KLEstimator = "low_var_kl"
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman 2020).

    ``k1`` (``kl``): ``logp - ref``, unbiased but high variance and can be negative.
    ``k2`` (``mse``): ``0.5 * (logp - ref)^2``. ``k3`` (``low_var_kl``):
    ``exp(ref - logp) - (ref - logp) - 1``, unbiased, always >= 0, clamped to +-10 as in verl.
    """
    diff = log_probs - ref_log_probs
    if estimator in ("k1", "kl"):
        return diff
    if estimator in ("k2", "mse"):
        return 0.5 * diff.square()
    if estimator in ("k3", "low_var_kl"):
        neg = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(neg) - neg - 1).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown kl_loss_type '{estimator}'; valid types: ['k1', 'k2', 'k3', 'kl', 'low_var_kl', 'mse']")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim: ``logsumexp(z) - sum(softmax(z) * z)``."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def compute_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    rollout_log_probs: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    num_tokens: Optional[float | torch.Tensor] = None,
    num_seqs: Optional[float | torch.Tensor] = None,
) -> PolicyLossOutput:
    """The full policy loss of one (micro-)batch: clipped surrogate x behaviour weight, plus
    ``kl_loss_coef`` x KL to the reference, minus ``entropy_coeff`` x entropy, each aggregated
    with ``config.loss_agg_mode``. ``ref_log_probs`` is required when ``kl_loss_coef > 0``;
    ``entropy`` (``[B, R]``) is required when ``entropy_coeff > 0`` and is only reported otherwise."""
    mask = response_mask.bool()
    terms = clipped_surrogate(
        log_probs,
        old_log_probs,
        advantages,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        clip_ratio_c=config.clip_ratio_c,
    )
    pg = terms.loss
    ratio = terms.ratio.detach()
    metrics: dict[str, torch.Tensor] = {
        "pg_clipfrac": masked_mean(terms.clipped.float(), mask),
        "pg_clipfrac_lower": masked_mean(terms.dual_clipped.float(), mask),
        "ppo_kl": masked_mean((old_log_probs - log_probs).detach(), mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": masked_max(ratio, mask),
    }
    if rollout_log_probs is not None and config.behav_imp_weight_cap is not None:
        weight, capped = behaviour_importance_weight(
            old_log_probs, rollout_log_probs, cap=config.behav_imp_weight_cap, mode=config.behav_imp_weight_mode
        )
        pg = pg * weight
        metrics["behav_imp_weight_mean"] = masked_mean(weight, mask)
        metrics["behav_imp_weight_max"] = masked_max(weight, mask)
        metrics["behav_capped_frac"] = masked_mean(capped.float(), mask)
    if rollout_log_probs is not None:
        metrics["rollout_kl"] = masked_mean((rollout_log_probs - old_log_probs).detach(), mask)
    metrics["pg_loss"] = masked_mean(pg.detach(), mask)

    def agg(values: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(values, mask, config.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)

    loss = agg(pg)
    if config.kl_loss_coef > 0:
        if ref_log_probs is None:
            raise ValueError("kl_loss_coef > 0 needs ref_log_probs (a reference model)")
        kl = kl_penalty(log_probs, ref_log_probs, config.kl_loss_type)
        loss = loss + config.kl_loss_coef * agg(kl)
        metrics["kl_loss"] = masked_mean(kl.detach(), mask)
    if entropy is not None:
        if config.entropy_coeff > 0:
            loss = loss - config.entropy_coeff * agg(entropy)
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
    elif config.entropy_coeff > 0:
        raise ValueError("entropy_coeff > 0 needs the per-token entropy")
    return PolicyLossOutput(loss=loss, metrics=metrics)


__all__ = [
    "LossAggMode",
    "KLEstimator",
    "PolicyLossConfig",
    "SurrogateTerms",
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
