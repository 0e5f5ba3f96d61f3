"""A trainer's step log: one metrics row per step, the run's totals and its summary.

Kept apart from the loop (:mod:`rollfleet.trainer.base`) because it only reads what the loop
counted: the clock, trained tokens, each group's staleness, the last weight sync's times.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping, Optional

from rollfleet.trainer.config import TrainConfig
from rollfleet.trainer.runtime import TrainerRuntime
from rollfleet.trainer.staleness import Group
from rollfleet.trainer.tracking import RunTracker


class StepLog:
    """The :class:`~rollfleet.trainer.base.Trainer`'s metrics (its state is the trainer's)."""

    runtime: TrainerRuntime
    train: TrainConfig
    tracker: Optional[RunTracker]
    progress: Optional[Callable[[dict[str, Any]], Any]]
    run_dir: Path
    mode_name: ClassVar[str]
    step: int
    version: int
    syncs: int
    trained_tokens: int
    trained_log: list[dict[str, Any]]
    idle_s: float
    wall_s: float
    _last_step_end: float
    _last_sync: Optional[dict[str, Any]] = None  # the last weight sync's result (its times)

    #: Run totals the checkpoint resumed from had counted (see :meth:`run_totals`; replaced on a
    #: resume, never changed in place), and this session's first row of the history.
    _totals_before: Mapping[str, Any] = MappingProxyType({})
    _session_rows_from = 0

    def _log_step(
        self,
        groups: list[Group],
        info: dict[str, Any],
        metrics: dict[str, Any],
        tokens: int,
        *,
        wait_s: float,
        synced: bool,
    ) -> None:
        assert self.tracker is not None
        now = self.runtime.clock()
        step_s = now - self._last_step_end
        self._last_step_end = now
        self.trained_tokens += tokens
        stale = [self.version_at_train(g) for g in groups]
        self.trained_log.append(
            {
                "step": self.step,
                "staleness": stale,
                "task_indices": [g.task_index for g in groups],
                "max_response_len": max((len(o.response_ids) for g in groups for o in g.outputs), default=0),
            }
        )
        self.idle_s += wait_s
        row = {
            "step": self.step,
            "version": self.version,
            "syncs": self.syncs,
            "step_s": step_s,
            "wait_s": wait_s,
            "idle_frac": wait_s / step_s if step_s > 0 else 0.0,
            "perf/tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            "staleness/mean": statistics.fmean(stale) if stale else 0.0,
            "staleness/max": max(stale) if stale else 0,
            "resumes": sum(g.resumes for g in groups),
            **info,
            **metrics,
        }
        if synced and self._last_sync:
            for key in ("total_s", "stage_s", "commit_s", "verify_s", "pause_s"):  # where a sync's time went
                if key in self._last_sync:
                    row[f"sync/{key}"] = self._last_sync[key]
        self.tracker.log(row)
        if self.progress is not None:
            self.progress(row)

    def version_at_train(self, group: Group) -> int:
        """Staleness of a group for the step being trained (the version before this step's sync)."""
        trained_version = self.version if self.step % self.train.parameter_sync_step else self.version - 1
        return max(0, trained_version - group.min_version)

    def session_totals(self) -> dict[str, Any]:
        """Counters a mode logs as totals of the run (dropped groups, regenerations): this
        session's own. A mode with any overrides this."""
        return {}

    def run_totals(self) -> dict[str, Any]:
        """:meth:`session_totals` plus what the checkpoint resumed from had counted: a resumed
        run's totals go on, where they started again from 0 in the same ``metrics.jsonl``."""
        return {k: self._totals_before.get(k, 0) + v for k, v in self.session_totals().items()}

    def summary(self) -> dict[str, Any]:
        """The run's rewards and steps; its times (``wall_s``, ``step_s_mean``, ``idle_frac``) are
        this session's, over its ``session_steps`` (a resumed run's earlier sessions are not timed here)."""
        rows = self.tracker.history if self.tracker else []
        first = [r["reward/mean"] for r in rows[: max(1, len(rows) // 5)] if "reward/mean" in r]
        last = [r["reward/mean"] for r in rows[-max(1, len(rows) // 5) :] if "reward/mean" in r]
        step_times = [r["step_s"] for r in rows[self._session_rows_from :]]
        return {
            "mode": self.mode_name,
            "steps": self.step,
            "session_steps": len(step_times),
            "syncs": self.syncs,
            "wall_s": self.wall_s,
            "step_s_mean": statistics.fmean(step_times) if step_times else 0.0,
            "idle_frac": self.idle_s / self.wall_s if self.wall_s else 0.0,
            "reward_first": statistics.fmean(first) if first else 0.0,
            "reward_last": statistics.fmean(last) if last else 0.0,
            "run_dir": str(self.run_dir),
        }
