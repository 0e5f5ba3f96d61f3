"""What a plan plans (:class:`PlanSpec`): a config and the cluster it runs on, checked before
anything runs, and each mode's share of the cluster (:mod:`rollfleet.plan.planner` runs it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from rollfleet.config import RollfleetConfig
from rollfleet.trainer import get_trainer_cls
from rollfleet.trainer.config import TrainConfig

MODES = ("sync", "colocate_async", "separate_async")


def generating_gpus(gpus: int, tp: int, share: float) -> int:
    """``share`` of ``gpus`` accelerators, rounded down to whole replicas of ``tp`` (the 1e-9: a
    share such as 0.29 x 100 is 28.999... in floating point, and means 29)."""
    return math.floor(gpus * share + 1e-9) // tp * tp


@dataclass(frozen=True)
class PlanSpec:
    """What to plan: a config and the cluster it runs on."""

    config: RollfleetConfig
    gpus: int
    tp: int = 1
    rollout_share: float = 0.5  # of the accelerators, for separate_async
    more_shares: tuple[float, ...] = ()  # separate_async at these splits too
    modes: tuple[str, ...] = MODES
    seeds: tuple[int, ...] = (0, 1, 2)
    warmup_steps: int = 1  # excluded from the step time: the first step fills an empty pipeline
    output_dir: str = "runs/plan"

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.gpus < self.tp:
            raise ValueError(f"gpus ({self.gpus}) must hold at least one replica of tp={self.tp}")
        for share in self.shares:
            if not 0 < share < 1:
                raise ValueError(f"rollout_share must be in (0, 1), got {share}")
        for name, values in (("modes", self.modes), ("seeds", self.seeds), ("rollout shares", self.shares)):
            if not values:
                raise ValueError(f"{name} must not be empty")
            if len(set(values)) < len(values):
                raise ValueError(f"{name} must not repeat, got {list(values)}")
        for mode in self.modes:
            get_trainer_cls(mode)  # UnknownName (a ValueError) lists the registered modes
        if self.gpus % self.tp and set(self.modes) - {"separate_async"}:
            raise ValueError(
                f"gpus ({self.gpus}) must be a multiple of tp ({self.tp}): sync and colocate_async would leave "
                f"{self.gpus % self.tp} accelerator(s) idle"
            )
        if self.more_shares and "separate_async" not in self.modes:
            raise ValueError(
                f"rollout shares {list(self.more_shares)} beyond the first (--rollout-share) split separate_async, "
                f"which the modes planned (--modes) leave out: {list(self.modes)}"
            )
        if "separate_async" in self.modes:
            splits = [self.gpus_of("separate_async", share) for share in self.shares]
            for share, (generating, _) in zip(self.shares, splits):
                if generating < self.tp:
                    raise ValueError(
                        f"separate_async: rollout_share x gpus = {self.gpus * share:g} holds no tp={self.tp} replica"
                    )
                if self.gpus - generating < 1:
                    raise ValueError(
                        f"separate_async: rollout_share {share} leaves the learner none of the {self.gpus} "
                        f"accelerators (it needs at least 1)"
                    )
            if len(set(splits)) < len(splits):
                raise ValueError(
                    f"rollout shares {list(self.shares)} give the same split twice ({self.gpus} accelerators, "
                    f"whole tp={self.tp} replicas): {[f'{r}:{t}' for r, t in splits]}"
                )
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_steps >= self.train.total_steps:
            raise ValueError(
                f"trainer.total_steps ({self.train.total_steps}) must exceed warmup_steps ({self.warmup_steps})"
            )
        sim, rollout = self.config.rollout.sim, self.config.rollout
        if sim.tensor_parallel_size != self.tp:
            raise ValueError(
                f"tp ({self.tp}) differs from rollout.sim.tensor_parallel_size ({sim.tensor_parallel_size}), the "
                "replica the engine's step costs price: give costs for a tp-"
                f"{self.tp} replica (a profile calibrated there, or the roofline of --model-params-b) and set it to {self.tp}"
            )
        assert rollout.max_model_len is not None  # filled in by RolloutConfig
        sim.check_holds_a_sequence(rollout.max_model_len)

    @property
    def train(self) -> TrainConfig:
        """The config's trainer section, validated (a bad one fails here, its fields named)."""
        return TrainConfig.model_validate(self.config.trainer.model_dump())

    @property
    def shares(self) -> tuple[float, ...]:
        """Every split ``separate_async`` is planned at: ``rollout_share``, then ``more_shares``."""
        return (self.rollout_share, *self.more_shares)

    def shares_of(self, mode: str) -> tuple[Optional[float], ...]:
        """The splits ``mode`` runs at: every one for ``separate_async``; None (no split) else."""
        return self.shares if mode == "separate_async" else (None,)

    def gpus_of(self, mode: str, share: Optional[float] = None) -> tuple[int, int]:
        """The accelerators generating and those training in ``mode``: ``separate_async``
        generates on ``share`` of them (default ``rollout_share``), rounded down to whole replicas,
        and trains on the rest; the colocated modes take turns on the same ones."""
        if mode == "separate_async":
            share = self.rollout_share if share is None else share
            rollout = generating_gpus(self.gpus, self.tp, share)
            return rollout, self.gpus - rollout
        return self.gpus // self.tp * self.tp, self.gpus

    def share_of(self, mode: str, share: Optional[float] = None) -> tuple[int, float]:
        """Replicas and the learner's share of the accelerators in ``mode``."""
        rollout, learner = self.gpus_of(mode, share)
        return rollout // self.tp, learner / self.gpus

    def run_name(self, mode: str, seed: int, share: Optional[float] = None) -> str:
        """``{mode}-seed{seed}``; in a plan of several splits, with the split (``-24x8``)."""
        if mode == "separate_async" and self.more_shares:
            rollout, learner = self.gpus_of(mode, share)
            return f"{mode}-{rollout}x{learner}-seed{seed}"
        return f"{mode}-seed{seed}"

    def config_for(self, mode: str, seed: int, share: Optional[float] = None) -> RollfleetConfig:
        """The config one run of ``mode`` on ``seed`` runs: the plan's, with the keys in
        :data:`PLAN_OWNED` set by the plan."""
        replicas, learner_share = self.share_of(mode, share)
        doc = self.config.model_dump()
        trainer = doc["trainer"]
        # A plan always starts from step 0: resuming would pick up an earlier plan's checkpoints
        # in the same run folder (and report the steps left over, or none).
        trainer.update(
            trainer_mode=mode,
            seed=seed,
            output_dir=self.output_dir,
            run_name=self.run_name(mode, seed, share),
            resume=False,
        )
        if "task" not in self.config.trainer.model_fields_set:
            trainer["task"] = "synthetic"  # prompts of rollout.prompt_length tokens, nothing to score
        trainer["sim_learner"] = {**trainer.get("sim_learner", {}), "enabled": True, "resource_share": learner_share}
        rollout = doc["rollout"]
        if self.config.rollout.name != "sim":  # the sim planned serves the config's context, not its own
            rollout["sim"]["max_model_len"] = rollout["max_model_len"]
        rollout.update(name="sim", num_replicas=replicas)
        rollout["routing"]["seed"] = seed
        rollout["sim"].update(seed=seed, time_scale=1.0, tensor_parallel_size=self.tp)
        if "max_steps_per_wake" not in self.config.rollout.sim.model_fields_set:
            rollout["sim"]["max_steps_per_wake"] = 1_000_000  # fast-forward: the same steps, far fewer wakes
        if "cache_on_prefill" not in self.config.rollout.sim.model_fields_set:
            rollout["sim"]["cache_on_prefill"] = True  # as vLLM: siblings that start together share a prompt
        return RollfleetConfig.model_validate(doc)


#: The config keys every plan sets itself (:meth:`PlanSpec.config_for`) and the flag that sets
#: each, if one does: a value the config or ``--vary`` gives them is not what runs.
PLAN_OWNED: dict[str, Optional[str]] = {
    "trainer.trainer_mode": "--modes",
    "trainer.seed": "--seeds",
    "trainer.output_dir": "--out",
    "trainer.run_name": "--out",
    "trainer.resume": None,
    "trainer.sim_learner.enabled": None,
    "trainer.sim_learner.resource_share": "--rollout-share",
    "rollout.name": None,
    "rollout.num_replicas": "--gpus and --tp",
    "rollout.routing.seed": "--seeds",
    "rollout.sim.seed": "--seeds",
    "rollout.sim.time_scale": None,
    "rollout.sim.tensor_parallel_size": "--tp",
}

__all__ = ["MODES", "PLAN_OWNED", "PlanSpec", "generating_gpus"]
