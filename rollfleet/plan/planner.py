"""A training plan: every trainer mode run on the same simulated cluster, in virtual time.

Inputs (:class:`PlanSpec`): a rollfleet config (the sim engine's step costs, the workload, the
trainer's batch, staleness and sync settings) and the cluster: ``gpus`` accelerators, ``tp`` per
replica, and the share that ``separate_async`` gives to rollout. Each mode runs the real trainer
code (:class:`~rollfleet.plan.runtime.VirtualRuntime`) on its share of the cluster:

* ``sync`` and ``colocate_async`` take turns on all of it: ``gpus // tp`` replicas generate, then
  the learner trains on every accelerator (the fleet paused meanwhile);
* ``separate_async`` splits it: ``rollout_share`` of the accelerators generate while the learner
  trains on the rest, so its steps take longer by the inverse of its share. ``more_shares`` plans
  it at other splits too, beside the first (which split trains fastest is what a plan of it asks).

Replicas cache a prompt's blocks once it is prefilled, as vLLM does (``rollout.sim.cache_on_prefill``
unless the config sets it), so the siblings of a GRPO group that start together share its prompt.
The learner's cost is ``trainer.sim_learner.seconds_per_token`` on the whole cluster, or derived
from the model size (:mod:`rollfleet.plan.learner_cost`). Each mode runs once per seed (the seed
draws the prompts and response lengths and seeds the routing policy); results are means with
their range. The same spec gives the same numbers on any host: nothing here reads a wall clock.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import as_completed
from contextlib import contextmanager
from typing import Optional

from rollfleet.plan.result import ModeRun, PlanResult
from rollfleet.plan.runtime import VirtualRuntime
from rollfleet.plan.spec import MODES, PlanSpec
from rollfleet.plan.workers import plan_pool
from rollfleet.trainer import get_trainer_cls
from rollfleet.utils import virtual_time

#: About how long a run of each mode takes, relative to ``sync``: ``benchmarks/plan_speed.py``'s
#: 128-accelerator workload, 100 steps, gave 55, 104 and 69 s. The async modes serve more than
#: they train on: ``colocate_async`` resumes what each sync aborted, ``separate_async`` drops
#: stragglers (before the staleness bound held its rollouter back, it dropped four times as many
#: and was the longest). Spread over processes, the longest runs start first, so that none starts
#: last on a worker that has already run another (longest-processing-time order); a mode not
#: listed counts as the longest. Only the order matters.
RELATIVE_RUN_COST = {"sync": 1.0, "colocate_async": 1.9, "separate_async": 1.25}


async def run_mode(spec: PlanSpec, mode: str, seed: int, share: Optional[float] = None) -> ModeRun:
    """One mode on one seed (``separate_async`` at ``share``, default the spec's
    ``rollout_share``); call on a virtual-time loop (:func:`rollfleet.utils.virtual_time.run`)."""
    if mode == "separate_async" and share is None:
        share = spec.rollout_share
    runtime = VirtualRuntime()
    trainer = get_trainer_cls(mode)(spec.config_for(mode, seed, share), runtime=runtime)
    try:
        await trainer.init()
        await trainer.fit()
        assert runtime.fleet is not None and runtime.learner is not None and trainer.tracker is not None
        report = await runtime.fleet.report()
        learner_busy = runtime.learner.busy_s
        trained_tokens = trainer.trained_tokens  # response tokens of every trained group
        trained_samples = sum(len(t["task_indices"]) for t in trainer.trained_log) * trainer.config.rollout.n
    finally:
        await trainer.close()
    rows = trainer.tracker.history[spec.warmup_steps :]
    steps_s = sum(r["step_s"] for r in rows)
    busy = sum(report.busy_s.values())
    replicas = len(report.busy_s)
    # Accelerator-seconds used: each replica's busy time on its tp devices, the learner's on its
    # share (colocated modes share the devices, but the fleet is paused while the learner trains).
    _, learner_share = spec.share_of(mode, share)
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
        rollout_share=share,
    )


def _run_one(spec: PlanSpec, mode: str, seed: int, share: Optional[float]) -> ModeRun:
    """One mode on one seed on a fresh virtual-time loop (also a worker process's entry point)."""
    with _fewer_collections():
        return virtual_time.run(run_mode(spec, mode, seed, share))


@contextmanager
def _fewer_collections(young: int = 200_000, middle: int = 20, old: int = 100) -> Iterator[None]:
    """Run the cyclic garbage collector less often while a plan runs.

    A plan keeps millions of token ids in live lists, and the collector walks every container
    each time it runs; with Python's default thresholds (700, 10, 10) that was a quarter of the
    wall time of a 128-accelerator ``sync`` plan (``plan_speed.py``'s workload, 8 steps: 1.25 s a
    step, 0.92 s with the collector off, 0.97 s with a young threshold of 50,000). Even a young
    collection walks every list made since the last one, and a step's responses are 2.3 million
    token ids in lists still alive when it runs: at 50,000 that was 10-12% of a ``sync`` or
    ``separate_async`` plan of 15 steps (0.7 s of 6.5 and 0.9 s of 8.3); at 200,000 it is 0-3%,
    with the same peak memory. Reference cycles are still freed."""
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
    jobs = [
        (k, mode, share, seed)
        for k, spec in enumerate(specs)
        for mode in spec.modes
        for share in spec.shares_of(mode)
        for seed in spec.seeds
    ]
    runs: list[Optional[ModeRun]] = [None] * len(jobs)

    def finished(i: int, run: ModeRun) -> None:
        runs[i] = run
        if on_run is not None:
            on_run(run)

    if workers <= 1 or len(jobs) == 1:
        for i, (k, mode, share, seed) in enumerate(jobs):
            finished(i, _run_one(specs[k], mode, seed, share))
    else:
        with plan_pool(min(workers, len(jobs))) as pool:
            order = start_order([(mode, seed) for _, mode, _, seed in jobs]) if longest_first else range(len(jobs))
            futures = {}
            for i in order:
                k, mode, share, seed = jobs[i]
                futures[pool.submit(_run_one, specs[k], mode, seed, share)] = i
            for future in as_completed(futures):  # a failed run fails the plan at once (plan_pool)
                finished(futures[future], future.result())
    return [
        PlanResult(spec, [r for (k, *_), r in zip(jobs, runs) if k == index and r is not None])
        for index, spec in enumerate(specs)
    ]


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
]
