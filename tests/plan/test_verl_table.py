"""The plans of verl's fully-async table: the learner fitted to verl's columns, priced as fitted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollfleet.plan.verl_table import (
    ASYNC_LOCAL_STEPS,
    VERL_ROWS,
    Assumed,
    LearnerFit,
    fit_learner,
    learner_fits,
    row_specs,
)
from rollfleet.trainer.config import TrainConfig
from rollfleet.trainer.sim_learner import SimulatedLearner

pytestmark = pytest.mark.unit


def test_the_fit_recovers_a_fixed_and_a_splitting_cost():
    exact = LearnerFit(a=40.0, b=6000.0)
    fit = fit_learner([16, 32, 64], [exact.seconds(g) for g in (16, 32, 64)])
    assert fit.a == pytest.approx(40.0) and fit.b == pytest.approx(6000.0)
    # a fixed cost that would come out negative is 0, and b is fitted through the origin
    through_origin = fit_learner([16, 32, 64], [100.0, 45.0, 20.0])
    assert through_origin.a == 0.0
    assert through_origin.b == pytest.approx((100 / 16 + 45 / 32 + 20 / 64) / (1 / 16**2 + 1 / 32**2 + 1 / 64**2))
    with pytest.raises(ValueError, match="two different"):
        fit_learner([32, 32], [10.0, 12.0])


def test_verl_rows_add_up_and_the_fits_follow_its_columns():
    speedups = [round(r.speedup, 2) for r in VERL_ROWS]
    assert speedups == [2.68, 1.93, 2.37]
    assert [round(100 * r.trainer_idle) for r in VERL_ROWS] == [7, 15, 22]
    fits = learner_fits()
    for row in VERL_ROWS:  # two constants over three rows: async within 10% of each, sync within 25%
        assert fits["separate_async"].seconds(row.gpus / 2) == pytest.approx(row.async_update, rel=0.1)
        assert fits["sync"].seconds(row.gpus) == pytest.approx(row.sync_update + row.sync_old_log_prob, rel=0.25)


def test_verl_windows_come_from_its_total_times():
    """The published "(1.72x)" speed-ups over the first 100 steps, and per-window steps whose
    mean over the 400 steps is 1-4% above the table's step (the totals include validation)."""
    assert [round(r.speedup_100, 2) for r in VERL_ROWS] == [1.72, 2.09, 2.67]
    for row in VERL_ROWS:
        for mode, step in (("sync", row.sync_step), ("async", row.async_step)):
            windows = row.window_steps(mode)
            assert len(windows) == 4 and min(windows) > 0
            assert 1.01 < sum(windows) / 4 / step < 1.04, (row.gpus, mode, windows)
    # the 32-GPU sync run: 494 s per step over its first 100 steps, 1,142 s over its last 100
    assert [round(s) for s in VERL_ROWS[0].window_steps("sync")] == [494, 503, 1067, 1142]
    with pytest.raises(KeyError):
        VERL_ROWS[0].window_steps("colocate")


@pytest.mark.parametrize("scale", [0.25, 0.5])
def test_a_step_of_the_mean_length_costs_the_fitted_seconds_at_any_scale(scale):
    """The plan's learner charges a + b / GPUs for a 512-prompt step of the assumed mean length,
    whatever fraction of verl's cluster it runs (the async one over its four local steps, on half
    the accelerators)."""
    assumed = Assumed(prompt_tokens=256, mean_response_tokens=1000)
    row = VERL_ROWS[1]
    fits = learner_fits()
    specs = row_specs(row, assumed, scale=scale, fits=fits)
    sample = assumed.prompt_tokens + int(assumed.mean_response_tokens)
    for mode, spec in specs.items():
        local_steps = 1 if mode == "sync" else ASYNC_LOCAL_STEPS
        train = TrainConfig.model_validate(spec.config_for(mode, 0).trainer.model_dump())
        samples = train.train_batch_size * 16
        assert samples == 512 * 16 * scale / local_steps
        batch = SimpleNamespace(attention_mask=torch.ones(samples, sample))
        seconds, _ = SimulatedLearner(train.sim_learner).step(batch)
        gpus = row.gpus if mode == "sync" else row.gpus / 2
        assert seconds * local_steps == pytest.approx(fits[mode].seconds(gpus), rel=1e-6)
        replicas, _ = spec.share_of(mode)
        assert replicas == (row.gpus * scale // 4 if mode == "sync" else row.gpus * scale // 8)


def test_a_scale_too_small_for_two_replicas_or_uneven_local_steps_is_refused():
    with pytest.raises(ValueError, match="too few"):
        row_specs(VERL_ROWS[0], scale=0.125)
    with pytest.raises(ValueError, match="local steps"):
        row_specs(VERL_ROWS[2], scale=0.2)  # 102 prompts


def test_another_split_moves_the_learner_and_the_rollouters_prompts_in_flight_with_it():
    """verl's rows split half and half; at 40:24 the async learner costs a + b / 24 a step and the
    rollouter keeps 16 prompts in flight per server of the 10 that generate. A split rounds down to
    whole replicas, as every plan's does."""
    assumed = Assumed(prompt_tokens=256, mean_response_tokens=1000)
    row, fits = VERL_ROWS[1], learner_fits()
    spec = row_specs(row, assumed, fits=fits, rollout_share=0.625)["separate_async"]
    assert spec.gpus_of("separate_async") == (40, 24) and spec.share_of("separate_async")[0] == 10
    train = TrainConfig.model_validate(spec.config_for("separate_async", 0).trainer.model_dump())
    assert train.max_inflight_groups == 10 * 16
    samples = train.train_batch_size * 16
    batch = SimpleNamespace(attention_mask=torch.ones(samples, assumed.prompt_tokens + 1000))
    seconds, _ = SimulatedLearner(train.sim_learner).step(batch)
    assert seconds * ASYNC_LOCAL_STEPS == pytest.approx(fits["separate_async"].seconds(24), rel=1e-6)
    assert row_specs(row, assumed, rollout_share=0.55)["separate_async"].gpus_of("separate_async") == (32, 32)
    for share in (1.0, 0.03):  # none left to train; no whole replica
        with pytest.raises(ValueError, match="holds no whole tp=4 replica with an accelerator left to train"):
            row_specs(row, assumed, rollout_share=share)
