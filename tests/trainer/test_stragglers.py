"""The staleness strategies against stragglers, in virtual time.

``separate_async`` on 4 prompts a step where one response in ten takes 75x the others (2 tokens or
150: several steps of a simulated learner that takes 0.1 s a step): the rollouter may run one
version ahead of the learner (bound 1), so the short groups that start after a long one finish and
are trained before it. Every sample is seeded, so the same prompts are the long ones in every run.

These run the real trainer, rollouter, agent loops, client, balancer and sim replicas on a
virtual-time loop (:class:`rollfleet.plan.VirtualRuntime`): each engine step and learner step
costs simulated seconds only, so which groups go stale cannot move with the host's load (on real
Ray, in wall time, a loaded CI host once let the straggler finish in time). ``test_modes.py`` runs
every mode on Ray.
"""

from __future__ import annotations

import pytest
from trainer_support import sim_train_config

from rollfleet.plan import VirtualRuntime
from rollfleet.trainer import Trainer, get_trainer_cls
from rollfleet.utils import virtual_time

pytestmark = pytest.mark.unit


def stragglers(tmp_path, **trainer):
    rollout = {
        "response_length": 160,
        "max_model_len": 256,
        "full_determinism": True,
        "sim.time_scale": 1.0,
        "sim.response_lengths": [2] * 9 + [150],
    }
    learner = {"sim_learner.enabled": True, "sim_learner.seconds_per_step": 0.1, "sim_learner.seconds_per_token": 0.0}
    return sim_train_config(tmp_path, "separate_async", rollout, **{"train_batch_size": 4, **learner, **trainer})


def fit(cfg) -> Trainer:
    """Run the job to its end in virtual time."""

    async def go() -> Trainer:
        trainer = get_trainer_cls(cfg.trainer.trainer_mode)(cfg, runtime=VirtualRuntime())
        try:
            await trainer.init()
            await trainer.fit()
        finally:
            await trainer.close()
        return trainer

    return virtual_time.run(go())


def test_drop_discards_stale_groups_and_replaces_them(tmp_path):
    """A straggler overtaken by two batches of groups that started after it is dropped, and
    another group takes its place: every step still trains a full batch."""
    trainer = fit(stragglers(tmp_path, total_steps=12, max_off_policy_steps=1, max_off_policy_strategy="drop"))
    assert trainer.step == 12
    assert all(s <= 1 for entry in trainer.trained_log for s in entry["staleness"])
    dropped = sum(r["staleness/dropped"] for r in trainer.tracker.history)
    assert dropped > 0, "a straggler two versions behind must have been dropped"
    assert all(len(e["staleness"]) == 4 for e in trainer.trained_log)  # replaced: every step still full


def test_bound_0_generates_nothing_ahead(tmp_path):
    """Bound 0 is on-policy: the rollouter starts no group before the weights it would be trained
    on are out, so none goes stale and drop has nothing to drop."""
    trainer = fit(stragglers(tmp_path, total_steps=4, max_off_policy_steps=0, max_off_policy_strategy="drop"))
    assert trainer.step == 4
    assert all(s == 0 for entry in trainer.trained_log for s in entry["staleness"])
    assert sum(r["staleness/dropped"] for r in trainer.tracker.history) == 0
    assert trainer.tracker.history[-1]["rollout/waits"] > 0  # held back, not dropped


def test_mask_trains_every_group_and_masks_stale_tokens(tmp_path):
    trainer = fit(stragglers(tmp_path, total_steps=12, max_off_policy_steps=1, max_off_policy_strategy="mask"))
    history = trainer.tracker.history
    assert sum(r["staleness/dropped"] for r in history) == 0
    assert sum(r["staleness/masked_tokens"] for r in history) > 0, "a straggler's old tokens are masked"
    assert all(len(e["staleness"]) == 4 for e in trainer.trained_log)


def test_trained_tokens_count_only_what_the_loss_sees(tmp_path):
    """Masked stale tokens used to be counted as trained (in ``trained_tokens``, each step's
    ``perf/tokens_per_s`` and its plot): here about half of them."""
    cfg = stragglers(tmp_path, total_steps=12, max_off_policy_steps=1, max_off_policy_strategy="mask")
    in_loss: list[int] = []

    async def go() -> Trainer:
        trainer = get_trainer_cls(cfg.trainer.trainer_mode)(cfg, runtime=VirtualRuntime())
        try:
            await trainer.init()
            learner = trainer.learner
            update = learner.update

            async def counting(batch):
                in_loss.append(int(batch.response_mask.sum()))
                return await update(batch)

            learner.update = counting
            await trainer.fit()
        finally:
            await trainer.close()
        return trainer

    trainer = virtual_time.run(go())
    history = trainer.tracker.history
    assert sum(r["staleness/masked_tokens"] for r in history) > 0
    assert trainer.trained_tokens == sum(in_loss)
    per_step = [round(r["perf/tokens_per_s"] * r["step_s"]) for r in history]
    assert per_step == in_loss
