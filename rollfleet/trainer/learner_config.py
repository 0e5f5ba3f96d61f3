"""The learner's settings and its policy loss's, without torch.

They are config sections (``trainer.learner``): every process that loads a config validates them,
including those that never train (``rollfleet plan``'s own, which spreads the runs over workers;
a fleet's). Keeping them here, apart from the learner and the losses that use them, spares those
processes importing torch (1.3 s here; 1.7 s of the 8.7 s ``make plan`` took).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollfleet.trainer.advantage_registry import check_advantage_options

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "kl", "k2", "mse", "k3", "low_var_kl"]


class PolicyLossConfig(BaseModel):
    """The loss section of the learner config (verl names where verl has one)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    clip_ratio_low: float = Field(0.2, gt=0, lt=1, description="Lower clip: ratio >= 1 - clip_ratio_low.")
    clip_ratio_high: float = Field(
        0.2, gt=0, description="Upper clip: ratio <= 1 + clip_ratio_high (DAPO 'clip-higher' uses 0.28)."
    )
    clip_ratio_c: Optional[float] = Field(
        3.0, gt=1, description="Dual-clip bound for negative advantages (Ye et al. 2020); None disables it."
    )
    behav_imp_weight_cap: Optional[float] = Field(
        5.0,
        gt=0,
        description="Cap on exp(old - rollout) log probs (decoupled PPO); None ignores rollout_log_probs.",
    )
    behav_imp_weight_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="'truncate': min(w, cap); 'mask': w = 0 where w > cap (AReaL)."
    )
    loss_agg_mode: LossAggMode = Field(
        "token-mean",
        description="token-mean (DAPO), seq-mean-token-sum, seq-mean-token-mean (original GRPO), "
        "seq-mean-token-sum-norm (Dr. GRPO: token sum / response length R).",
    )
    kl_loss_coef: float = Field(0.0, ge=0, description="Coefficient of the KL-to-reference loss; 0 disables it.")
    kl_loss_type: KLEstimator = Field("low_var_kl", description="k1|kl, k2|mse, k3|low_var_kl (Schulman's estimators).")
    entropy_coeff: float = Field(0.0, ge=0, description="Entropy bonus: loss -= entropy_coeff * entropy.")

    @model_validator(mode="after")
    def _check_dual_clip(self) -> "PolicyLossConfig":
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1 + self.clip_ratio_high:
            raise ValueError(
                f"clip_ratio_c ({self.clip_ratio_c}) must exceed 1 + clip_ratio_high ({1 + self.clip_ratio_high})"
            )
        return self


class LearnerConfig(BaseModel):
    """Learner settings. Defaults suit the built-in ``tiny`` model on CPU; for a real LLM use
    ``lr`` around 1e-6 to 1e-5 and ``bfloat16`` compute on GPU (the parameters stay float32)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    lr: float = Field(1e-3, gt=0, description="AdamW learning rate (constant).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    weight_decay: float = Field(0.01, ge=0, description="AdamW decoupled weight decay.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: Optional[float] = Field(1.0, gt=0, description="Clip the global grad norm; None: no clip.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each batch per update.")
    mini_batch_size: Optional[int] = Field(
        None, ge=1, description="Sequences per optimizer step; None: the whole batch (one step per epoch)."
    )
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward (memory bound only).")
    shuffle: bool = Field(False, description="Shuffle sequences before splitting into mini-batches each epoch.")
    seed: int = Field(0, description="Seed of the mini-batch shuffle (combined with the step).")
    temperature: float = Field(1.0, gt=0, description="Logits are divided by it: must match the sampling temperature.")
    adv_estimator: str = Field("grpo", description="Registered advantage estimator: grpo | drgrpo | rloo | ...")
    adv_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options of the estimator, e.g. {'norm_adv_by_std': False}."
    )
    loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig, description="Policy loss settings.")
    ref_model_path: Optional[str] = Field(
        None, description="Reference model for the KL loss (loaded only if loss.kl_loss_coef > 0); None: the policy's."
    )
    device: Optional[str] = Field(None, description="torch device; None: 'cuda' if available, else 'cpu'.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description=(
            "Compute dtype. bfloat16/float16 run forward and backward under autocast; the policy's "
            "parameters and AdamW's state stay float32 (master weights: a bfloat16 weight of ~0.016 "
            "moves in steps of 6e-5, so updates of lr 1e-6 rounded away), the reference model is "
            "held in this dtype, and weights go to the engines in it."
        ),
    )
    attn_implementation: Optional[str] = Field("sdpa", description="transformers attention backend; None: its default.")
    keep_last_checkpoints: int = Field(3, ge=1, description="Checkpoints kept by save() (older ones deleted).")

    @model_validator(mode="after")
    def _check(self) -> "LearnerConfig":
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be in [0, 1), got {self.betas}")
        check_advantage_options(self.adv_estimator, self.adv_options)
        return self


__all__ = ["LearnerConfig", "PolicyLossConfig", "LossAggMode", "KLEstimator"]
