"""verl's published fully-async table, and the plans that predict it.

verl's ``docs/advance/fully_async.md`` (as first published, commit 6f0b21c53; the current doc has
two ``update_actor`` cells swapped) times DAPO on Qwen2.5-Math-7B with responses up to 28K tokens
on H20s: colocated ``sync`` on 32, 64 and 128 accelerators against ``fully_async_policy`` on the
same accelerators split in half (16:16, 32:32, 64:64). A row's step is 512 prompts x 16 samples in
both (the async trainer syncs weights after 4 local steps of 4 x 32 prompts; its step sums them).

:func:`row_specs` builds the two plans of one row, sync and ``separate_async``, from three kinds
of input, kept apart so that a reader can tell what the prediction rests on:

* **verl's setup** (from its scripts and rollouter): the model's shape, H20s, rollout tensor
  parallelism 4, 512 x 16 samples, 28K-token responses, the async row's batches, sync interval,
  staleness threshold and partial rollout, 16 prompts in flight per server and at most
  (1 + staleness) x a sync's prompts started (in flight or finished) ahead of the trainer;
* **the learner, fitted to verl's own training columns**: a learner step costs ``a + b / gpus``
  (``b`` the work that splits over accelerators, ``a`` what does not: optimizer steps, collectives,
  the slowest micro-batch), fitted by least squares over the three rows, once for the colocated
  trainer (``update_actor`` + ``old_log_prob``) and once for the async one (``update_actor``:
  it takes the rollout's log-probs). Two constants each for three rows: the learner is
  calibrated, not read off per row;
* **assumed** (verl publishes neither): the prompts' length and the responses' length
  distribution (log-normal, one for every row), and how long a weight sync stalls the rollout.

Generation, which is what rollfleet simulates, is predicted: the sim engine's step costs come
from the roofline (:mod:`rollfleet.plan.roofline`) of the model on an H20 at tp 4, and the sync
run's generation time, the async trainer's wait and hence both step times come out of the plan.

A plan may run at a fraction of verl's size (``scale``): the accelerators and the prompts of a
step shrink together, so every replica and every accelerator of the learner carries the load it
carries in verl's run; only the longest of fewer samples is drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollfleet.config import load_config
from rollfleet.plan.calibrate import nonnegative_lstsq
from rollfleet.plan.planner import PlanSpec
from rollfleet.plan.roofline import accelerator, engine_costs
from rollfleet.plan.spec import generating_gpus


@dataclass(frozen=True)
class VerlRow:
    """One row pair of verl's table (seconds per step of 512 prompts x 16 samples)."""

    gpus: int  # sync: all of them; async: half generate, half train
    sync_step: float
    sync_gen: float
    sync_old_log_prob: float
    sync_update: float
    async_step: float
    async_gen: float  # the async trainer's wait for samples
    async_update: float
    staleness: float  # the async script's staleness_threshold
    #: the runs' total times after 100, 200, 300 and 400 steps (hours; the table's "total time" columns)
    sync_totals_h: tuple[float, float, float, float]
    async_totals_h: tuple[float, float, float, float]

    @property
    def speedup(self) -> float:
        return self.sync_step / self.async_step

    @property
    def trainer_idle(self) -> float:
        """verl's trainer idle ratio: the async trainer's wait over its step."""
        return self.async_gen / self.async_step

    @property
    def speedup_100(self) -> float:
        """verl's speed-up over the first 100 steps (the table's "(1.72x)"): the total times then."""
        return self.sync_totals_h[0] / self.async_totals_h[0]

    def window_steps(self, mode: str) -> list[float]:
        """Seconds per step of ``mode``'s run (``sync`` or ``async``) in each 100-step window, from
        the total times. They show whether a run stayed one workload: a stationary plan can match a
        mean over windows only where the windows agree."""
        totals = {"sync": self.sync_totals_h, "async": self.async_totals_h}[mode]
        ends = (0.0, *totals)
        return [(b - a) * 3600 / STEPS_PER_WINDOW for a, b in zip(ends, ends[1:])]


def _h(days: int, hours: int, minutes: int) -> float:
    return days * 24 + hours + minutes / 60


#: verl's table (doc commit 6f0b21c53). Staleness: the 16:16 and 32:32 scripts set 0.1, the 64:64
#: run used 0.5 (the doc's setting and its staleness ablation's row). A step is the mean over 400
#: steps; the total times are as published (13h 44m, 1d 3h 43m, ...).
VERL_ROWS: tuple[VerlRow, ...] = (
    VerlRow(
        32, 790.10, 357.41, 107.71, 313.81, 294.77, 21.26, 269.80, 0.1,
        (_h(0, 13, 44), _h(1, 3, 43), _h(2, 9, 22), _h(3, 17, 5)),
        (_h(0, 7, 58), _h(0, 16, 21), _h(1, 0, 53), _h(1, 9, 26)),
    ),
    VerlRow(
        64, 365.28, 150.72, 70.26, 133.41, 189.26, 28.46, 156.98, 0.1,
        (_h(0, 10, 22), _h(0, 20, 45), _h(1, 7, 6), _h(1, 17, 32)),
        (_h(0, 4, 57), _h(0, 10, 14), _h(0, 16, 58), _h(0, 21, 40)),
    ),
    VerlRow(
        128, 356.30, 177.85, 53.92, 113.81, 150.63, 33.14, 113.16, 0.5,
        (_h(0, 8, 36), _h(0, 17, 56), _h(1, 5, 6), _h(1, 16, 48)),
        (_h(0, 3, 13), _h(0, 6, 46), _h(0, 10, 53), _h(0, 17, 22)),
    ),
)  # fmt: skip

PROMPTS = 512
SAMPLES = 16
STEPS_PER_WINDOW = 100  # the table's total times are given every 100 steps
ASYNC_LOCAL_STEPS = 4  # trigger_parameter_sync_step: local steps of 4 x 32 prompts per weight sync
PROMPTS_IN_FLIGHT_PER_SERVER = 16  # verl's rollouter: max_concurrent_samples = servers x 16 prompts
MAX_RESPONSE = 28 * 1024
TP = 4
#: Qwen2.5-(Math-)7B: parameters (billions), layers, hidden size, KV bytes per token (bf16, 4 KV heads of 128).
PARAMS_B, LAYERS, HIDDEN, KV_BYTES_PER_TOKEN = 7.6, 28, 3584, 57_344


@dataclass(frozen=True)
class LearnerFit:
    """A learner step of one 512-prompt batch on ``gpus`` accelerators: ``a + b / gpus`` seconds."""

    a: float
    b: float

    def seconds(self, gpus: float) -> float:
        return self.a + self.b / gpus


def fit_learner(gpus: list[float], seconds: list[float]) -> LearnerFit:
    """Least squares of ``a + b / gpus`` through (gpus, seconds), both constants >= 0
    (:func:`~rollfleet.plan.calibrate.nonnegative_lstsq`: a constant that would come out negative
    is 0 and the other is fitted alone)."""
    if len(gpus) != len(seconds) or len(gpus) < 2 or min(gpus) <= 0:
        raise ValueError("fit_learner needs two or more (gpus > 0, seconds) points")
    if len(set(gpus)) < 2:
        raise ValueError("fit_learner needs two different accelerator counts")
    x = np.column_stack([np.ones(len(gpus)), 1.0 / np.asarray(gpus, dtype=float)])
    a, b = nonnegative_lstsq(x, np.asarray(seconds, dtype=float))
    return LearnerFit(float(a), float(b))


def learner_fits(rows: tuple[VerlRow, ...] = VERL_ROWS) -> dict[str, LearnerFit]:
    """The colocated trainer (update + old log-probs, on all of a row's accelerators) and the async
    trainer (update, on half of them), fitted to verl's columns."""
    return {
        "sync": fit_learner([r.gpus for r in rows], [r.sync_update + r.sync_old_log_prob for r in rows]),
        "separate_async": fit_learner([r.gpus / 2 for r in rows], [r.async_update for r in rows]),
    }


@dataclass(frozen=True)
class Assumed:
    """What verl does not publish, one value for every row."""

    prompt_tokens: int = 256
    mean_response_tokens: float = 1500.0
    response_sigma: float = 1.4
    weight_load_ms: float = 15_000.0  # how long a weight sync stalls every replica


def row_specs(
    row: VerlRow,
    assumed: Assumed = Assumed(),
    *,
    scale: float = 1.0,
    steps: int = 4,
    seeds: tuple[int, ...] = (0,),
    output_dir: str = "runs/verl_table",
    fits: dict[str, LearnerFit] | None = None,
    strategy: str = "drop",
    rollout_share: float = 0.5,
) -> dict[str, PlanSpec]:
    """The row's two plans, ``sync`` and ``separate_async``, at ``scale`` of verl's size; ``steps``
    512-prompt steps each (the first left out). An async plan's step is one local step (a
    quarter of verl's): multiply its step time by :data:`ASYNC_LOCAL_STEPS`. ``strategy``: the
    async plan's ``trainer.max_off_policy_strategy``. ``rollout_share``: the async plan's split
    (verl's: half), in whole tp-4 replicas; the rollouter's prompts in flight follow its servers,
    the learner (``a + b / gpus``) its accelerators."""
    gpus = round(row.gpus * scale)
    if gpus < 2 * TP:
        raise ValueError(f"scale {scale}: {row.gpus} accelerators become {gpus}, too few for two tp={TP} halves")
    rollout_gpus = generating_gpus(gpus, TP, rollout_share)  # as the plan's PlanSpec rounds it
    if not TP <= rollout_gpus <= gpus - 1:
        raise ValueError(
            f"rollout_share {rollout_share:g} of {gpus} accelerators holds no whole tp={TP} replica with an "
            "accelerator left to train"
        )
    if round(PROMPTS * scale) % ASYNC_LOCAL_STEPS:
        raise ValueError(
            f"scale {scale}: {PROMPTS} prompts become {round(PROMPTS * scale)}, not {ASYNC_LOCAL_STEPS} equal local steps"
        )
    fits = fits or learner_fits()
    device = accelerator("h20")
    costs = engine_costs(PARAMS_B, device, tp=TP, kv_bytes_per_token=KV_BYTES_PER_TOKEN, layers=LAYERS, hidden=HIDDEN)
    # The fitted b is accelerator-seconds per step of verl's tokens; priced per token of this
    # workload's mean step, on this (scaled) cluster, so a step of the mean length costs a + b / gpus.
    step_tokens = PROMPTS * scale * SAMPLES * (assumed.prompt_tokens + assumed.mean_response_tokens)
    base: dict[str, Any] = {
        "rollout.name": "sim",
        "rollout.n": SAMPLES,
        "rollout.prompt_length": assumed.prompt_tokens,
        "rollout.response_length": MAX_RESPONSE,
        "rollout.max_model_len": MAX_RESPONSE + assumed.prompt_tokens,
        "rollout.sim.mean_response_tokens": assumed.mean_response_tokens,
        "rollout.sim.response_sigma": assumed.response_sigma,
        "rollout.sim.weight_load_ms": assumed.weight_load_ms,
        "rollout.sim.tensor_parallel_size": TP,  # the replica the roofline's costs price
        "agent.num_workers": 4,
        **{f"rollout.sim.{k}": v for k, v in costs.items()},
    }
    specs = {}
    for mode, local_steps in (("sync", 1), ("separate_async", ASYNC_LOCAL_STEPS)):
        fit = fits[mode]
        overrides = {
            **base,
            "trainer.sim_learner.seconds_per_token": fit.b / row.gpus / step_tokens,
            "trainer.sim_learner.seconds_per_step": fit.a / local_steps,
            "trainer.train_batch_size": round(PROMPTS * scale) // local_steps,
            "trainer.parameter_sync_step": local_steps,
            "trainer.total_steps": steps * local_steps,
        }
        if mode == "separate_async":
            # verl's rollouter: 16 prompts in flight per server, and at most (1 + staleness) x a
            # sync's prompts started (in flight or finished) ahead of the trainer, its
            # staleness_samples pause: the staleness bound holds rollfleet's rollouter to the same
            # (GroupBuffer.may_start); the queue bound caps the finished ones alone.
            replicas = rollout_gpus // TP
            overrides.update(
                {
                    "trainer.max_off_policy_steps": row.staleness,
                    "trainer.max_off_policy_strategy": strategy,
                    "trainer.partial_rollout": True,
                    "trainer.max_inflight_groups": replicas * PROMPTS_IN_FLIGHT_PER_SERVER,
                    "trainer.max_queue_groups": math.ceil((1 + row.staleness) * round(PROMPTS * scale)),
                }
            )
        specs[mode] = PlanSpec(
            load_config(None, overrides),
            gpus=gpus,
            tp=TP,
            rollout_share=rollout_share,
            modes=(mode,),
            seeds=seeds,
            warmup_steps=local_steps,
            output_dir=f"{output_dir}/{row.gpus}",
        )
    return specs


__all__ = [
    "VERL_ROWS",
    "VerlRow",
    "LearnerFit",
    "Assumed",
    "fit_learner",
    "learner_fits",
    "row_specs",
    "ASYNC_LOCAL_STEPS",
]
