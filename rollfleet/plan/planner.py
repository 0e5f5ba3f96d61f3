"""A training plan: every trainer mode run on the same simulated cluster, in virtual time.

Inputs (:class:`PlanSpec`): a rollfleet config (the sim engine's step costs, the workload, the
trainer's batch, staleness and sync settings) and the cluster: ``gpus`` accelerators, ``tp`` per
replica, and the share that ``separate_async`` gives to rollout. Each mode runs the real trainer
code (:class:`~rollfleet.plan.runtime.VirtualRuntime`) on its share of the cluster:

* ``sync`` and ``colocate_async`` take turns on all of it: ``gpus // tp`` replicas generate, then
  the learner trains on every accelerator (the fleet paused meanwhile);
* ``separate_async`` splits it: ``rollout_share`` of the accelerators generate while the learner
  trains on the rest, so its steps take longer by the inverse of its share.

Replicas cache a prompt's blocks once it is prefilled, as vLLM does (``rollout.sim.cache_on_prefill``
unless the config sets it), so the siblings of a GRPO group that start together share its prompt.
The learner's cost is ``trainer.sim_learner.seconds_per_token`` on the whole cluster, or derived
from the model size (:mod:`rollfleet.plan.learner_cost`). Each mode runs once per seed (the seed
draws the prompts and response lengths and seeds the routing policy); results are means with
their range. The same spec gives the same numbers on any host: nothing here reads a wall clock.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import statistics
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rollfleet.config import RollfleetConfig
from rollfleet.plan.runtime import VirtualRuntime
from rollfleet.trainer import get_trainer_cls
from rollfleet.trainer.config import TrainConfig
from rollfleet.utils import virtual_time

MODES = ("sync", "colocate_async", "separate_async")

#: About how long a run of each mode takes, relative to ``sync``: ``benchmarks/plan_speed.py``'s
#: 128-accelerator workload, 100 steps, gave 55, 104 and 69 s. The async modes serve more than
#: they train on: ``colocate_async`` resumes what each sync aborted, ``separate_async`` drops
#: stragglers (before the staleness bound held its rollouter back, it dropped four times as many
#: and was the longest). Spread over processes, the longest runs start first, so that none starts
#: last on a worker that has already run another (longest-processing-time order); a mode not
#: listed counts as the longest. Only the order matters.
RELATIVE_RUN_COST = {"sync": 1.0, "colocate_async": 1.9, "separate_async": 1.25}


@dataclass(frozen=True)
class PlanSpec:
    """What to plan: a config and the cluster it runs on."""

    config: RollfleetConfig
    gpus: int
    tp: int = 1
    rollout_share: float = 0.5  # of the accelerators, for separate_async
    modes: tuple[str, ...] = MODES
    seeds: tuple[int, ...] = (0, 1, 2)
    warmup_steps: int = 1  # excluded from the step time: the first step fills an empty pipeline
    output_dir: str = "runs/plan"

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.gpus < self.tp:
            raise ValueError(f"gpus ({self.gpus}) must hold at least one replica of tp={self.tp}")
        if not 0 < self.rollout_share < 1:
            raise ValueError(f"rollout_share must be in (0, 1), got {self.rollout_share}")
        for name, values in (("modes", self.modes), ("seeds", self.seeds)):
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
        if "separate_async" in self.modes and self.gpus_of("separate_async")[0] < self.tp:
            raise ValueError(
                f"separate_async: rollout_share x gpus = {self.gpus * self.rollout_share:g} holds no tp={self.tp} replica"
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
        if sim.kv_capacity_tokens < rollout.max_model_len:
            raise ValueError(
                f"rollout.sim.kv_capacity_tokens ({sim.kv_capacity_tokens:,}) holds less than one sequence of "
                f"rollout.max_model_len ({rollout.max_model_len:,}) tokens: vLLM would refuse to start such a replica; "
                "raise tp, or lower the lengths"
            )

    @property
    def train(self) -> TrainConfig:
        """The config's trainer section, validated (a bad one fails here, its fields named)."""
        return TrainConfig.model_validate(self.config.trainer.model_dump())

    def gpus_of(self, mode: str) -> tuple[int, int]:
        """The accelerators generating and those training in ``mode``: ``separate_async``
        generates on ``rollout_share`` of them, rounded down to whole replicas, and trains on the
        rest; the colocated modes take turns on the same ones."""
        if mode == "separate_async":
            rollout = math.floor(self.gpus * self.rollout_share + 1e-9) // self.tp * self.tp
            return rollout, self.gpus - rollout
        return self.gpus // self.tp * self.tp, self.gpus

    def share_of(self, mode: str) -> tuple[int, float]:
        """Replicas and the learner's share of the accelerators in ``mode``."""
        rollout, learner = self.gpus_of(mode)
        return rollout // self.tp, learner / self.gpus

    def config_for(self, mode: str, seed: int) -> RollfleetConfig:
        replicas, share = self.share_of(mode)
        doc = self.config.model_dump()
        trainer = doc["trainer"]
        # A plan always starts from step 0: resuming would pick up an earlier plan's checkpoints
        # in the same run folder (and report the steps left over, or none).
        trainer.update(
            trainer_mode=mode, seed=seed, output_dir=self.output_dir, run_name=f"{mode}-seed{seed}", resume=False
        )
        if "task" not in self.config.trainer.model_fields_set:
            trainer["task"] = "synthetic"  # prompts of rollout.prompt_length tokens, nothing to score
        trainer["sim_learner"] = {**trainer.get("sim_learner", {}), "enabled": True, "resource_share": share}
        rollout = doc["rollout"]
        rollout.update(name="sim", num_replicas=replicas)
        rollout["routing"]["seed"] = seed
        rollout["sim"].update(seed=seed, time_scale=1.0, tensor_parallel_size=self.tp)
        if "max_steps_per_wake" not in self.config.rollout.sim.model_fields_set:
            rollout["sim"]["max_steps_per_wake"] = 1_000_000  # fast-forward: the same steps, far fewer wakes
        if "cache_on_prefill" not in self.config.rollout.sim.model_fields_set:
            rollout["sim"]["cache_on_prefill"] = True  # as vLLM: siblings that start together share a prompt
        return RollfleetConfig.model_validate(doc)


@dataclass
class ModeRun:
    """One mode on one seed, in simulated seconds."""

    mode: str
    seed: int
    replicas: int
    step_s: float  # mean, after warm-up
    trainer_idle: float  # share of the trainer's time spent waiting for samples (after warm-up)
    fleet_idle: float  # share of the replicas' time with nothing to run (whole run)
    cluster_idle: float  # share of accelerator time spent neither generating nor training (whole run)
    staleness_mean: float
    staleness_max: int
    dropped_groups: int  # dropped as too stale (whole run, warm-up included, as the counts below)
    tokens_per_s: float  # response tokens trained on per second (after warm-up), not generated
    run_dir: str
    # What the fleet served for the samples trained on (whole run, warm-up included): tokens
    # generated per token trained (1.0: nothing generated in vain; groups dropped as stale, and
    # groups finished but not trained when the run ends, add) and requests per trained sample (1.0:
    # one each; every resume after an abort, a weight sync's in colocate_async, and every sample of
    # a dropped group add one). A resume re-sends the prompt and the tokens so far.
    generated_per_trained: float
    requests_per_sample: float


@dataclass
class PlanResult:
    spec: PlanSpec
    runs: list[ModeRun] = field(default_factory=list)

    def by_mode(self) -> dict[str, list[ModeRun]]:
        out: dict[str, list[ModeRun]] = {}
        for r in self.runs:
            out.setdefault(r.mode, []).append(r)
        return out

    def summary(self) -> list[dict[str, Any]]:
        """Per mode: means over seeds (and the step time's range); speed-up over ``sync`` is the
        mean of the per-seed ratios (same seed, same prompts)."""
        modes = self.by_mode()
        sync = {r.seed: r.step_s for r in modes.get("sync", [])}
        rows = []
        for mode, runs in modes.items():
            rollout_gpus, learner_gpus = self.spec.gpus_of(mode)
            speedups = [sync[r.seed] / r.step_s for r in runs if r.seed in sync and r.step_s > 0]
            low, high = min(r.step_s for r in runs), max(r.step_s for r in runs)
            rows.append(
                {
                    "mode": mode,
                    "replicas": runs[0].replicas,
                    # fmean of equal values can round past them (three of 3.7990400000000344 give
                    # ...035): held in the range, or the plot's error bars go negative and it fails
                    "step_s": min(max(statistics.fmean(r.step_s for r in runs), low), high),
                    "step_s_range": [low, high],
                    "speedup_vs_sync": statistics.fmean(speedups) if speedups else None,
                    "trainer_idle": statistics.fmean(r.trainer_idle for r in runs),
                    "fleet_idle": statistics.fmean(r.fleet_idle for r in runs),
                    "cluster_idle": statistics.fmean(r.cluster_idle for r in runs),
                    "staleness_mean": statistics.fmean(r.staleness_mean for r in runs),
                    "staleness_max": max(r.staleness_max for r in runs),
                    "rollout_gpus": rollout_gpus,
                    "learner_gpus": learner_gpus,
                    "dropped_groups": statistics.fmean(r.dropped_groups for r in runs),
                    "tokens_per_s": statistics.fmean(r.tokens_per_s for r in runs),
                    "generated_per_trained": statistics.fmean(r.generated_per_trained for r in runs),
                    "requests_per_sample": statistics.fmean(r.requests_per_sample for r in runs),
                }
            )
        return rows


async def run_mode(spec: PlanSpec, mode: str, seed: int) -> ModeRun:
    """One mode on one seed; call on a virtual-time loop (:func:`rollfleet.utils.virtual_time.run`)."""
    runtime = VirtualRuntime()
    trainer = get_trainer_cls(mode)(spec.config_for(mode, seed), runtime=runtime)
    try:
        await trainer.init()
        await trainer.fit()
        assert runtime.fleet is not None and runtime.learner is not None and trainer.tracker is not None
        report = await runtime.fleet.report()
        learner_busy = runtime.learner.busy_s
        trained_tokens = trainer.generated_tokens  # response tokens of every trained group
        trained_samples = sum(len(t["task_indices"]) for t in trainer.trained_log) * trainer.config.rollout.n
    finally:
        await trainer.close()
    rows = trainer.tracker.history[spec.warmup_steps :]
    steps_s = sum(r["step_s"] for r in rows)
    busy = sum(report.busy_s.values())
    replicas = len(report.busy_s)
    # Accelerator-seconds used: each replica's busy time on its tp devices, the learner's on its
    # share (colocated modes share the devices, but the fleet is paused while the learner trains).
    _, learner_share = spec.share_of(mode)
    used = busy * spec.tp + learner_busy * learner_share * spec.gpus
    span = spec.gpus * report.makespan_s
    return ModeRun(
        mode=mode,
        seed=seed,
        replicas=replicas,
        step_s=steps_s / len(rows),
        trainer_idle=sum(r["wait_s"] for r in rows) / steps_s if steps_s else 0.0,
        fleet_idle=1.0 - busy / (replicas * report.makespan_s) if report.makespan_s else 0.0,
        cluster_idle=max(0.0, 1.0 - used / span) if span else 0.0,
        staleness_mean=statistics.fmean(r["staleness/mean"] for r in rows),
        staleness_max=int(max(r["staleness/max"] for r in rows)),
        dropped_groups=int(sum(r.get("staleness/dropped", 0) for r in trainer.tracker.history)),
        tokens_per_s=sum(r["perf/tokens_per_s"] * r["step_s"] for r in rows) / steps_s if steps_s else 0.0,
        run_dir=str(trainer.run_dir),
        generated_per_trained=report.output_tokens / trained_tokens if trained_tokens else 0.0,
        requests_per_sample=sum(report.requests.values()) / trained_samples if trained_samples else 0.0,
    )


def _run_one(spec: PlanSpec, mode: str, seed: int) -> ModeRun:
    """One mode on one seed on a fresh virtual-time loop (also a worker process's entry point)."""
    with _fewer_collections():
        return virtual_time.run(run_mode(spec, mode, seed))


@contextmanager
def _fewer_collections(young: int = 50_000, middle: int = 20, old: int = 100) -> Iterator[None]:
    """Run the cyclic garbage collector less often while a plan runs.

    A plan keeps millions of token ids in live lists, and the collector walks every container
    each time it runs; with Python's default thresholds (700, 10, 10) that was a quarter of the
    wall time of a 128-accelerator ``sync`` plan (``plan_speed.py``'s workload, 8 steps: 1.25 s a
    step, 0.92 s with the collector off, 0.97 s with these thresholds). They keep most of that
    gain and still free reference cycles."""
    before = gc.get_threshold()
    gc.set_threshold(young, middle, old)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def start_order(jobs: list[tuple[str, int]]) -> list[int]:
    """The indices of ``jobs`` (mode, seed) in the order to start them on a pool of processes:
    longest first by :data:`RELATIVE_RUN_COST` (a mode it does not list first of all), seeds of
    one mode in their order."""
    return sorted(range(len(jobs)), key=lambda i: -RELATIVE_RUN_COST.get(jobs[i][0], float("inf")))


def run_plan(
    spec: PlanSpec,
    on_run: Optional[Callable[[ModeRun], None]] = None,
    workers: int = 1,
    longest_first: bool = True,
) -> PlanResult:
    """Every mode on every seed, each on a fresh virtual-time loop (blocking).

    ``workers`` > 1 spreads the runs over that many processes: a plan is CPU-bound Python, one core
    each, and a 100-step plan of a large cluster runs minutes a mode. They are spawned (fresh
    interpreters: nothing inherited from a caller holding Ray, threads or a loop), the longest first
    (:data:`RELATIVE_RUN_COST`; ``longest_first=False`` starts them in the spec's order, which
    ``benchmarks/plan_speed.py`` times beside it). Every run is deterministic, so the plan is the
    same either way, in the same order; ``on_run`` sees runs as they finish."""
    return run_plans([spec], on_run, workers, longest_first)[0]


def run_plans(
    specs: Sequence[PlanSpec],
    on_run: Optional[Callable[[ModeRun], None]] = None,
    workers: int = 1,
    longest_first: bool = True,
) -> list[PlanResult]:
    """:func:`run_plan` of several specs (a config each: another staleness strategy, another
    cluster) on one pool of processes, so that no worker idles between one plan and the next."""
    jobs = [(k, mode, seed) for k, spec in enumerate(specs) for mode in spec.modes for seed in spec.seeds]
    runs: list[Optional[ModeRun]] = [None] * len(jobs)

    def finished(i: int, run: ModeRun) -> None:
        runs[i] = run
        if on_run is not None:
            on_run(run)

    if workers <= 1 or len(jobs) == 1:
        for i, (k, mode, seed) in enumerate(jobs):
            finished(i, _run_one(specs[k], mode, seed))
    else:
        pool = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn"))
        try:
            order = start_order([(mode, seed) for _, mode, seed in jobs]) if longest_first else range(len(jobs))
            futures = {pool.submit(_run_one, specs[jobs[i][0]], *jobs[i][1:]): i for i in order}
            for future in as_completed(futures):
                finished(futures[future], future.result())
        finally:  # a failed run fails the plan at once: the runs not started are dropped
            pool.shutdown(wait=True, cancel_futures=True)
    return [
        PlanResult(spec, [r for (k, _, _), r in zip(jobs, runs) if k == index and r is not None])
        for index, spec in enumerate(specs)
    ]


def write_plan(result: PlanResult, out: str | Path) -> list[Path]:
    """``plan.json`` (the summary and every run) and ``plan.png`` (step time and idle fractions
    per mode) under ``out``; each run's own timeline PNG is in its run folder."""
    import json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = result.spec
    doc = {
        "gpus": spec.gpus,
        "tp": spec.tp,
        "rollout_share": spec.rollout_share,
        "seeds": list(spec.seeds),
        "summary": result.summary(),
        "runs": [vars(r) for r in result.runs],
    }
    json_path = out / "plan.json"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    return [json_path, _plot_summary(result, out / "plan.png")]


def _plot_summary(result: PlanResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.summary()
    names = [r["mode"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    errs = [[r["step_s"] - r["step_s_range"][0] for r in rows], [r["step_s_range"][1] - r["step_s"] for r in rows]]
    ax1.bar(names, [r["step_s"] for r in rows], yerr=errs, color="#4c72b0", capsize=4)
    ax1.set_ylabel("simulated seconds per step")
    ax1.set_title(f"step time ({result.spec.gpus} accelerators, tp {result.spec.tp})")
    x = range(len(rows))
    bars = [
        ("trainer_idle", "trainer idle", "#d9d9d9"),
        ("fleet_idle", "fleet idle", "#c44e52"),
        ("cluster_idle", "cluster idle", "#8172b3"),
    ]
    for k, (key, label, color) in enumerate(bars):
        ax2.bar([i + (k - 1) * 0.27 for i in x], [r[key] for r in rows], width=0.27, label=label, color=color)
    ax2.set_xticks(list(x), names)
    ax2.set_ylim(0, 1)
    ax2.set_title("idle fractions")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = [
    "PlanSpec",
    "PlanResult",
    "ModeRun",
    "MODES",
    "RELATIVE_RUN_COST",
    "run_plan",
    "run_plans",
    "run_mode",
    "start_order",
    "write_plan",
]
