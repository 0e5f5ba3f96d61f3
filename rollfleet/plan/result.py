"""What a plan found: one mode's run on one seed (:class:`ModeRun`), and a plan's runs with their
summary over seeds (:class:`PlanResult`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from rollfleet.plan.spec import PlanSpec


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
    rollout_share: Optional[float] = None  # separate_async's split (of the spec's accelerators)


@dataclass
class PlanResult:
    spec: PlanSpec
    runs: list[ModeRun] = field(default_factory=list)

    def by_mode(self) -> dict[str, list[ModeRun]]:
        out: dict[str, list[ModeRun]] = {}
        for r in self.runs:
            out.setdefault(r.mode, []).append(r)
        return out

    def label(self, run: ModeRun) -> str:
        """The mode; in a plan of several splits, ``separate_async`` with its split (``24:8``)."""
        if run.mode == "separate_async" and self.spec.more_shares:
            return "{} {}:{}".format(run.mode, *self.spec.gpus_of(run.mode, run.rollout_share))
        return run.mode

    def summary(self) -> list[dict[str, Any]]:
        """Per mode (and split): means over seeds (and the step time's range); speed-up over
        ``sync`` is the mean of the per-seed ratios (same seed, same prompts)."""
        groups: dict[str, list[ModeRun]] = {}
        for r in self.runs:
            groups.setdefault(self.label(r), []).append(r)
        sync = {r.seed: r.step_s for r in self.by_mode().get("sync", [])}
        rows = []
        for label, runs in groups.items():
            mode, share = runs[0].mode, runs[0].rollout_share
            rollout_gpus, learner_gpus = self.spec.gpus_of(mode, share)
            speedups = [sync[r.seed] / r.step_s for r in runs if r.seed in sync and r.step_s > 0]
            low, high = min(r.step_s for r in runs), max(r.step_s for r in runs)
            rows.append(
                {
                    "mode": mode,
                    "label": label,
                    "rollout_share": share,
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
                    "tokens_per_s_range": [min(r.tokens_per_s for r in runs), max(r.tokens_per_s for r in runs)],
                    "generated_per_trained": statistics.fmean(r.generated_per_trained for r in runs),
                    "requests_per_sample": statistics.fmean(r.requests_per_sample for r in runs),
                }
            )
        return rows

    def best_split(self) -> Optional[dict[str, Any]]:
        """The summary row of the fastest ``separate_async`` split (:func:`fastest_split`), in a
        plan of several splits (None otherwise)."""
        return fastest_split(self.summary())


def fastest_split(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Of a plan's summary ``rows``, the ``separate_async`` split that trains the most tokens a
    second (the shorter step on a tie), where there are several (None otherwise). Not the shortest
    step alone: a split whose fleet falls behind drops more stale groups, the long ones first, so
    its steps train fewer tokens; the ranking of varied plans counts the same way."""
    splits = [r for r in rows if r["mode"] == "separate_async"]
    return min(splits, key=lambda r: (-r["tokens_per_s"], r["step_s"])) if len(splits) > 1 else None


__all__ = ["ModeRun", "PlanResult", "fastest_split"]
