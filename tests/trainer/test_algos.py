"""Advantage estimators and policy losses against hand-computed numbers (no model involved)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rollfleet.trainer.algos import (
    PolicyLossConfig,
    aggregate_loss,
    available_advantage_estimators,
    behaviour_importance_weight,
    check_advantage_options,
    clipped_surrogate,
    compute_advantages,
    compute_policy_loss,
    entropy_from_logits,
    group_index,
    grpo_advantages,
    kl_penalty,
    register_advantage_estimator,
    rloo_advantages,
)

pytestmark = pytest.mark.unit

EPS = 1e-6
LN2 = math.log(2.0)


# --------------------------------------------------------------------------- advantages

# Group "a" = scores 0, 2, 4 (mean 2, unbiased std sqrt((4 + 0 + 4) / 2) = 2); group "b" = 5, 5
# (equal rewards). Rows interleave the groups; the mask is ragged.
SCORES = torch.tensor([0.0, 5.0, 2.0, 5.0, 4.0])
UIDS = ["a", "b", "a", "b", "a"]
MASK = torch.tensor(
    [
        [1, 1, 1],
        [1, 1, 0],
        [1, 0, 0],
        [1, 1, 1],
        [1, 1, 0],
    ]
)


def _expected(per_seq: list[float]) -> torch.Tensor:
    return torch.tensor(per_seq).unsqueeze(-1) * MASK.float()


def test_grpo_two_groups_hand_computed():
    adv = grpo_advantages(SCORES, UIDS, MASK)
    a = 2.0 / (2.0 + EPS)  # (4 - 2) / (2 + eps)
    assert adv.dtype == torch.float32 and adv.shape == (5, 3)
    torch.testing.assert_close(adv, _expected([-a, 0.0, 0.0, 0.0, a]))


def test_grpo_equal_rewards_group_gets_zero():
    adv = grpo_advantages(SCORES, UIDS, MASK)
    assert torch.all(adv[[1, 3]] == 0)


def test_drgrpo_is_mean_only():
    adv = grpo_advantages(SCORES, UIDS, MASK, norm_adv_by_std=False)
    torch.testing.assert_close(adv, _expected([-2.0, 0.0, 0.0, 0.0, 2.0]))
    torch.testing.assert_close(compute_advantages("drgrpo", SCORES, UIDS, MASK), adv)


def test_rloo_leave_one_out_baseline():
    # 0 - mean(2, 4) = -3; 2 - mean(0, 4) = 0; 4 - mean(0, 2) = 3; group b: 5 - 5 = 0
    adv = rloo_advantages(SCORES, UIDS, MASK)
    torch.testing.assert_close(adv, _expected([-3.0, 0.0, 0.0, 0.0, 3.0]))


def test_singleton_group_gets_zero():
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 2.0]), ["x", "y", "y"], torch.ones(3, 2))
    assert torch.all(adv[0] == 0)
    # group y = 1, 2: mean 1.5, unbiased std sqrt(0.25 + 0.25) = sqrt(0.5)
    torch.testing.assert_close(adv[1:], torch.tensor([[-0.5, -0.5], [0.5, 0.5]]) / (math.sqrt(0.5) + EPS))


def test_uids_any_hashable_or_array():
    assert group_index([("p", 1), "q", ("p", 1)]).tolist() == [0, 1, 0]
    assert group_index(np.array(["u", "v", "u"])).tolist() == [0, 1, 0]
    assert group_index(torch.tensor([7, 7, 3])).tolist() == [0, 0, 1]
    by_tensor = grpo_advantages(SCORES, torch.tensor([0, 1, 0, 1, 0]), MASK)
    torch.testing.assert_close(by_tensor, grpo_advantages(SCORES, UIDS, MASK))


def test_registry_errors_name_valid_choices():
    assert {"grpo", "drgrpo", "rloo"} <= set(available_advantage_estimators())
    with pytest.raises(ValueError, match="valid names: .*grpo"):
        compute_advantages("ppo-gae", SCORES, UIDS, MASK)
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo", rloo_advantages)
    register_advantage_estimator("grpo", grpo_advantages)  # the identical target again: a no-op
    with pytest.raises(ValueError, match="norm_adv_by_std"):
        check_advantage_options("grpo", {"norm_by_std": False})
    check_advantage_options("grpo", {"norm_adv_by_std": False})


def test_bad_shapes_rejected():
    with pytest.raises(ValueError, match="uids"):
        grpo_advantages(SCORES, UIDS[:3], MASK)
    with pytest.raises(ValueError, match="response_mask"):
        grpo_advantages(SCORES, UIDS, MASK[:2])


# --------------------------------------------------------------------------- clipped surrogate

# (ratio, advantage, expected loss, clip active, dual clip active) with clip (0.2, 0.28), c = 3.
CASES = [
    (1.1, 1.0, -1.1, False, False),  # inside the range
    (1.5, 1.0, -1.28, True, False),  # A > 0 above 1 + 0.28: clipped at -1.28
    (0.5, 1.0, -0.5, False, False),  # A > 0 below 1 - 0.2: pessimistic = unclipped
    (0.5, -1.0, 0.8, True, False),  # A < 0 below 0.8: clipped at 0.8
    (1.5, -1.0, 1.5, False, False),  # A < 0 above the range: unclipped (pessimistic)
    (4.0, -1.0, 3.0, False, True),  # A < 0, ratio > c: dual clip bounds the loss at -A * c
    (4.0, 2.0, -2.56, True, False),  # A > 0 far above: -2 * 1.28
]


def _surrogate(clip_ratio_c):
    ratio = torch.tensor([[c[0] for c in CASES]])
    log_probs = ratio.log().requires_grad_(True)
    adv = torch.tensor([[c[1] for c in CASES]])
    terms = clipped_surrogate(
        log_probs, torch.zeros_like(log_probs), adv, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_ratio_c
    )
    return log_probs, terms


def test_clipped_surrogate_hand_computed():
    log_probs, terms = _surrogate(3.0)
    torch.testing.assert_close(terms.loss[0], torch.tensor([c[2] for c in CASES]))
    assert terms.clipped[0].tolist() == [c[3] for c in CASES]
    assert terms.dual_clipped[0].tolist() == [c[4] for c in CASES]
    # d(-A r)/d logp = -A r where the unclipped branch is active, 0 where a clip is
    terms.loss.sum().backward()
    torch.testing.assert_close(log_probs.grad[0], torch.tensor([-1.1, 0.0, -0.5, 0.0, 1.5, 0.0, 0.0]))


def test_without_dual_clip_large_ratio_is_unbounded():
    _, terms = _surrogate(None)
    assert terms.loss[0, 5].item() == pytest.approx(4.0)
    assert not terms.dual_clipped.any()


def test_policy_loss_metrics_clip_fractions_and_ratio():
    ratio = torch.tensor([[c[0] for c in CASES]])
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    out = compute_policy_loss(
        ratio.log(), torch.zeros_like(ratio), torch.tensor([[c[1] for c in CASES]]), torch.ones_like(ratio), cfg
    )
    assert out.loss.item() == pytest.approx(sum(c[2] for c in CASES) / 7, abs=1e-6)
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(3 / 7)
    assert out.metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 7)
    assert out.metrics["ratio_max"].item() == pytest.approx(4.0)
    assert out.metrics["ratio_mean"].item() == pytest.approx(sum(c[0] for c in CASES) / 7)
    assert out.metrics["ppo_kl"].item() == pytest.approx(-sum(math.log(c[0]) for c in CASES) / 7, abs=1e-6)


def test_dual_clip_must_exceed_upper_clip():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_high=0.28, clip_ratio_c=1.2)
    with pytest.raises(ValueError):
        PolicyLossConfig(loss_agg_mode="sum")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- aggregation

# Ragged: row lengths 3, 2, 1, 0. Masked-out slots hold 100 so any leak shows.
VALUES = torch.tensor(
    [
        [1.0, 2.0, 3.0, 100.0],
        [4.0, 5.0, 100.0, 100.0],
        [7.0, 100.0, 100.0, 100.0],
        [100.0, 100.0, 100.0, 100.0],
    ]
)
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
AGG_EXPECTED = {
    "token-mean": (1 + 2 + 3 + 4 + 5 + 7) / 6,  # 6 valid tokens
    "seq-mean-token-sum": (6 + 9 + 7) / 3,  # 3 non-empty sequences
    "seq-mean-token-mean": (2 + 4.5 + 7) / 3,
    "seq-mean-token-sum-norm": (6 + 9 + 7) / 4 / 3,  # token sums / R=4
}


@pytest.mark.parametrize("mode", sorted(AGG_EXPECTED))
def test_aggregation_modes_on_ragged_mask(mode):
    assert aggregate_loss(VALUES, AGG_MASK, mode).item() == pytest.approx(AGG_EXPECTED[mode])


@pytest.mark.parametrize("mode", sorted(AGG_EXPECTED))
def test_aggregation_split_with_global_counts_sums_to_whole(mode):
    parts = [
        aggregate_loss(VALUES[rows], AGG_MASK[rows], mode, num_tokens=6, num_seqs=3)
        for rows in (slice(0, 1), slice(1, 3), slice(3, 4))
    ]
    assert sum(p.item() for p in parts) == pytest.approx(AGG_EXPECTED[mode])


def test_aggregation_empty_mask_is_zero_not_nan():
    assert aggregate_loss(VALUES, torch.zeros_like(AGG_MASK), "token-mean").item() == 0.0


# --------------------------------------------------------------------------- decoupled PPO

# proximal (old) log probs 0; behaviour log probs -ln2, -ln8, +ln2 -> weights 2, 8, 0.5
OLD = torch.zeros(1, 3)
ROLLOUT = torch.tensor([[-LN2, -math.log(8.0), LN2]])


def test_behaviour_weight_truncate_and_mask():
    w, capped = behaviour_importance_weight(OLD, ROLLOUT, cap=5.0, mode="truncate")
    torch.testing.assert_close(w, torch.tensor([[2.0, 5.0, 0.5]]))
    assert capped.tolist() == [[False, True, False]]
    w, _ = behaviour_importance_weight(OLD, ROLLOUT, cap=5.0, mode="mask")
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.0, 0.5]]))


@pytest.mark.parametrize("mode,weights", [("truncate", [2.0, 5.0, 0.5]), ("mask", [2.0, 0.0, 0.5])])
def test_decoupled_loss_scales_surrogate_by_capped_weight(mode, weights):
    cfg = PolicyLossConfig(behav_imp_weight_cap=5.0, behav_imp_weight_mode=mode)
    log_probs = OLD.clone().requires_grad_(True)  # ratio 1: inside the clip
    out = compute_policy_loss(log_probs, OLD, torch.ones(1, 3), torch.ones(1, 3), cfg, rollout_log_probs=ROLLOUT)
    assert out.loss.item() == pytest.approx(-sum(weights) / 3)
    out.loss.backward()  # the weight is a constant: d/dlogp = -A * w * r / N
    torch.testing.assert_close(log_probs.grad, -torch.tensor([weights]) / 3)
    assert out.metrics["behav_imp_weight_max"].item() == pytest.approx(max(weights))
    assert out.metrics["behav_capped_frac"].item() == pytest.approx(1 / 3)


def test_no_cap_ignores_rollout_log_probs():
    cfg = PolicyLossConfig(behav_imp_weight_cap=None)
    out = compute_policy_loss(OLD, OLD, torch.ones(1, 3), torch.ones(1, 3), cfg, rollout_log_probs=ROLLOUT)
    assert out.loss.item() == pytest.approx(-1.0)
    assert "behav_imp_weight_mean" not in out.metrics


# --------------------------------------------------------------------------- KL, entropy


def test_kl_estimators_hand_computed():
    # policy p = 0.5, ref q = 0.25 (logp - ref = ln2); and the reverse (logp - ref = -ln2)
    logp = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.25), math.log(0.5)])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([LN2, -LN2]))
    torch.testing.assert_close(kl_penalty(logp, ref, "kl"), torch.tensor([LN2, -LN2]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5 * LN2**2, 0.5 * LN2**2]))
    # k3 = q/p - ln(q/p) - 1: 0.5 + ln2 - 1, 2 - ln2 - 1
    expected_k3 = torch.tensor([0.5 + LN2 - 1, 2 - LN2 - 1])
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), expected_k3)
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), expected_k3)
    # k3 of a huge log ratio is clamped at 10
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([20.0]), "k3").item() == 10.0


def test_kl_term_in_loss():
    cfg = PolicyLossConfig(kl_loss_coef=0.1, kl_loss_type="k1")
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.25)]])
    out = compute_policy_loss(logp, logp, torch.zeros(1, 2), torch.ones(1, 2), cfg, ref_log_probs=ref)
    assert out.loss.item() == pytest.approx(0.1 * LN2 / 2)  # pg term is 0 with A = 0
    assert out.metrics["kl_loss"].item() == pytest.approx(LN2 / 2)
    with pytest.raises(ValueError, match="ref_log_probs"):
        compute_policy_loss(logp, logp, torch.zeros(1, 2), torch.ones(1, 2), cfg)


def test_entropy_from_logits_and_bonus():
    logits = torch.tensor([[[math.log(0.5), math.log(0.25), math.log(0.25)], [0.0, 0.0, 0.0]]])
    h = entropy_from_logits(logits)
    torch.testing.assert_close(h, torch.tensor([[1.5 * LN2, math.log(3.0)]]))
    cfg = PolicyLossConfig(entropy_coeff=0.01)
    zeros = torch.zeros(1, 2)
    out = compute_policy_loss(zeros, zeros, zeros, torch.ones(1, 2), cfg, entropy=h)
    assert out.loss.item() == pytest.approx(-0.01 * (1.5 * LN2 + math.log(3.0)) / 2)
    assert out.metrics["entropy"].item() == pytest.approx((1.5 * LN2 + math.log(3.0)) / 2)
