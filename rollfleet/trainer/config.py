"""The trainer's configuration (the ``trainer`` section of the config tree).

Parsed from ``RollfleetConfig.trainer`` when a trainer is built, so the learner's settings live
next to the modes' without the bottom config layer importing the trainer. ``load_config`` checks
the section earlier, when the file loads, through :func:`validate_trainer_section` (registered by
import path in :data:`rollfleet.config.SECTION_VALIDATORS`): a misspelt key or an unknown
``trainer_mode`` fails before Ray starts, with the key named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollfleet.trainer.learner_config import LearnerConfig
from rollfleet.trainer.registry import TRAINER_REGISTRY


class SimLearnerConfig(BaseModel):
    """A learner that only takes time (for the sim engine's capacity planning and benchmarks)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = Field(False, description="Use the simulated learner instead of a torch model.")
    seconds_per_token: float = Field(
        2e-5,
        ge=0,
        description="Seconds of training per token of the batch (prompt and response: both go forward and "
        "backward) on the learner's full resources: the weights' FLOPs.",
    )
    seconds_per_token_squared: float = Field(
        0.0,
        ge=0,
        description="Seconds per squared sample length (prompt + response), summed over the samples: "
        "attention's FLOPs, quadratic in the length (long responses cost more than their token count says).",
    )
    seconds_per_step: float = Field(
        0.0, ge=0, description="Seconds every update costs whatever its size (optimizer step, gradient sync)."
    )
    resource_share: float = Field(
        1.0, gt=0, le=1, description="Fraction of the resources the learner gets (separate_async splits them)."
    )


class TrainConfig(BaseModel):
    """How training runs: the mode, the batch, weight sync, staleness, checkpoints, outputs."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    trainer_mode: str = Field("sync", description="Registered trainer: sync | colocate_async | separate_async.")
    run_name: str = Field("rollfleet", description="Outputs go to <output_dir>/<run_name>/.")
    output_dir: str = "runs"
    task: str = Field(
        "count",
        description="Built-in task (see rollfleet.trainer.tasks): count (learnable from scratch), or synthetic "
        "(prompts of rollout.prompt_length token ids, no reward to compute: what rollfleet plan runs).",
    )
    total_steps: int = Field(20, ge=1, description="Learner steps to run.")
    train_batch_size: int = Field(8, ge=1, description="Prompts (GRPO groups) per learner step.")
    parameter_sync_step: int = Field(1, ge=1, description="Learner steps between weight syncs to the fleet.")
    max_off_policy_steps: float = Field(
        2,
        ge=0,
        description="Most weight versions a trained token may lag: ceil of this (version now - version that sampled "
        "it). It also bounds how far ahead the rollouter runs, under every strategy: at most (this + 1) x a sync's "
        "groups started beyond what the learner has taken, so a fraction acts like verl's staleness_threshold "
        "(0.5 lets it start half a sync's groups more than the current version needs).",
    )
    max_off_policy_strategy: Literal["drop", "wait", "mask"] = Field(
        "drop",
        description="What becomes of a group that finishes past the bound (a straggler others overtook): drop: "
        "discard it (counted with its lengths) and generate another; wait: train groups in the order they started, "
        "so none goes stale or is dropped; mask: train every group but mask the tokens sampled more than the bound "
        "ago out of the loss.",
    )
    partial_rollout: bool = Field(
        True,
        description="Resume aborted requests on the new weights; off: every response stays one policy's (an "
        "aborted request is resumed only on the weights that sampled its tokens, as after colocate_async's pause of "
        "a step with no weight sync; across a sync its group is regenerated from scratch).",
    )
    max_queue_groups: Optional[int] = Field(
        None, ge=1, description="Bound of finished-but-untrained groups; default 2 x train_batch_size."
    )
    max_inflight_groups: Optional[int] = Field(
        None, ge=1, description="Groups generating at once in async modes; default 2 x train_batch_size."
    )
    num_warmup_batches: int = Field(1, ge=0, description="colocate_async: batches submitted ahead at start.")
    save_freq: int = Field(0, ge=0, description="Checkpoint every N steps (0: only at the end).")
    resume: bool = Field(False, description="Continue from the latest checkpoint of this run.")
    colocate: Optional[bool] = Field(
        None,
        description="The learner shares the replicas' devices (True) or gets a device of its own (False); "
        "None: the mode's default (sync, colocate_async: True; separate_async: False). Sets "
        "rollout.placement.colocate; a fleet that reserves nothing (sim engine without GPUs) places no learner.",
    )
    seed: int = 0
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    sim_learner: SimLearnerConfig = Field(default_factory=SimLearnerConfig)

    @field_validator("trainer_mode")
    @classmethod
    def _registered_mode(cls, mode: str) -> str:
        return TRAINER_REGISTRY.check_name(mode)  # names only: no mode is imported

    @model_validator(mode="after")
    def _defaults(self) -> "TrainConfig":
        if self.max_queue_groups is None:
            object.__setattr__(self, "max_queue_groups", 2 * self.train_batch_size)
        if self.max_inflight_groups is None:
            object.__setattr__(self, "max_inflight_groups", 2 * self.train_batch_size)
        return self


def validate_trainer_section(section: Mapping[str, Any]) -> None:
    """The ``trainer`` section validator of :func:`rollfleet.config.load_config`: raises
    ``pydantic.ValidationError`` naming the first bad key (unknown keys are errors)."""
    TrainConfig.model_validate(dict(section))


__all__ = ["TrainConfig", "SimLearnerConfig", "validate_trainer_section"]
