"""A resumed run's outputs go on from its checkpoint: ``metrics.jsonl`` holds each step once and
the timeline goes forward, though the run before crashed after logging steps past it. The real
trainer, client and sim replicas with the simulated learner, in virtual time."""

from __future__ import annotations

from typing import Any

import pytest
from trainer_support import sim_train_config

from rollfleet.plan import VirtualRuntime
from rollfleet.trainer import get_trainer_cls
from rollfleet.trainer.tracking import read_jsonl
from rollfleet.utils import virtual_time

pytestmark = pytest.mark.unit


def _run(cfg: Any, crash_at_update: int = 0) -> Any:
    async def go() -> Any:
        trainer = get_trainer_cls(cfg.trainer.trainer_mode)(cfg, runtime=VirtualRuntime())
        try:
            await trainer.init()
            update, calls = trainer.learner.update, [0]

            async def counted(batch: Any) -> Any:
                calls[0] += 1
                if calls[0] == crash_at_update:
                    raise RuntimeError("the node died (injected)")
                return await update(batch)

            trainer.learner.update = counted
            await trainer.fit()
        finally:
            await trainer.close()
        return trainer

    return virtual_time.run(go())


def test_a_resumed_run_logs_each_step_once_and_its_timeline_goes_on(tmp_path):
    def cfg(**trainer: Any) -> Any:
        rollout = {"sim.time_scale": 1.0}
        return sim_train_config(tmp_path, "sync", rollout, save_freq=2, **{"sim_learner.enabled": True}, **trainer)

    with pytest.raises(RuntimeError, match="injected"):
        _run(cfg(total_steps=6), crash_at_update=4)  # steps 1-3 logged, the checkpoint is step 2's
    run_dir = tmp_path / "sync"
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    resumed = _run(cfg(total_steps=6, resume=True))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # step 3 ran again: its first row is gone
    assert [r["step"] for r in resumed.tracker.history] == [1, 2, 3, 4, 5, 6]
    times = [r["time"] for r in rows]
    assert times == sorted(times) and len(set(times)) == 6
    spans = read_jsonl(run_dir / "timeline.jsonl")
    train = sorted(s["start"] for s in spans if s["kind"] == "train")
    assert len(train) == 6 and train[2] >= times[1]  # the step run again starts after the steps kept
    assert rows[-1]["syncs"] == 6  # restored from the checkpoint, not counted from 0 again


def test_run_totals_go_on_across_a_resume_and_the_summary_times_this_session(tmp_path):
    """``staleness/dropped_total`` and the other run totals started again from 0 after a resume,
    in the same ``metrics.jsonl``; the summary gave the whole run's steps with this session's wall
    time (a s/step that could not be true); a line cut off by the crash made --resume fail."""

    def cfg(**trainer: Any) -> Any:
        rollout = {
            "sim.time_scale": 1.0,
            "response_length": 100,
            "sim.mean_response_tokens": 30,
            "sim.response_sigma": 1.5,
        }
        return sim_train_config(
            tmp_path, "separate_async", rollout, save_freq=2, max_off_policy_steps=1,
            **{"sim_learner.enabled": True, "sim_learner.seconds_per_step": 0.5}, **trainer,
        )  # fmt: skip

    with pytest.raises(RuntimeError, match="injected"):
        _run(cfg(total_steps=8), crash_at_update=7)
    run_dir = tmp_path / "separate_async"
    before = read_jsonl(run_dir / "metrics.jsonl")
    kept = [r for r in before if r["step"] <= 6]
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "time": 1')  # the crash cut this line off
    resumed = _run(cfg(total_steps=8, resume=True))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    for key in ("staleness/dropped_total", "rollout/regenerated", "rollout/waits"):
        totals = [r[key] for r in rows]
        assert totals == sorted(totals), (key, totals)  # a total never goes back
    assert kept[-1]["rollout/waits"] >= 3  # counted before the crash: the resumed rows go on from there
    for key in ("staleness/dropped_total", "rollout/waits"):
        assert rows[6][key] >= kept[-1][key], key
    summary = resumed.summary()
    assert summary["steps"] == 8 and summary["session_steps"] == 2
    bad = run_dir / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')  # not the last line: not a torn write, an error
    with pytest.raises(ValueError, match="bad.jsonl: line 2 is not JSON"):
        read_jsonl(bad)
