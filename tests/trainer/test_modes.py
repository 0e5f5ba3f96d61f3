"""Trainer modes end to end on the simulated engine with the real tiny learner."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_support import sim_train_config

from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.trainer import Trainer, get_trainer_cls, register_trainer
from rollfleet.trainer.rollouter import spans_versions, was_aborted

pytestmark = pytest.mark.ray


async def run(cfg) -> Trainer:
    trainer = get_trainer_cls(cfg.trainer.trainer_mode)(cfg)
    try:
        await trainer.init()
        # The learner is an actor: its weights come as an ObjectRef, fetched here only to compare.
        before = {k: v.clone() for k, v in (await (await trainer.learner.state_dict_for_inference())).items()}
        trainer.summary_ = await trainer.fit()
        after = await (await trainer.learner.state_dict_for_inference())
        trainer.params_changed = any(not torch.equal(before[k], after[k]) for k in before)
        trainer.fleet_version = (await trainer.manager.status()).current_version
    finally:
        await trainer.close()
    return trainer


def test_registry_rejects_bad_registrations():
    with pytest.raises(TypeError, match="not a subclass of Trainer"):
        register_trainer("bogus")(object)
    with pytest.raises(ValueError, match="already registered"):

        @register_trainer("sync")
        class Other(Trainer):
            async def sample(self):  # pragma: no cover
                raise NotImplementedError

    with pytest.raises(ValueError, match="separate_async"):
        get_trainer_cls("nope")


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
async def test_each_mode_trains_and_the_fleet_follows(ray_session, tmp_path, mode):
    trainer = await run(config(tmp_path, mode))
    assert trainer.step == 3
    assert trainer.params_changed
    assert trainer.syncs == 3 and trainer.version == 3 == trainer.fleet_version
    rows = trainer.tracker.history
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("reward/mean" in r and "actor/pg_loss" in r for r in rows)
    assert (tmp_path / mode / "metrics.jsonl").exists()
    if mode == "sync":
        assert all(s == 0 for entry in trainer.trained_log for s in entry["staleness"])


@pytest.mark.parametrize(
    ("mode", "partial_rollout", "expected"),
    [
        ("sync", True, {"class": "rollfleet.client.llm_client.LLMServerClient"}),
        (
            "separate_async",
            False,
            {"class": "rollfleet.client.fully_async.FullyAsyncLLMServerClient", "partial_rollout": False},
        ),
        (
            "separate_async",
            True,
            {"class": "rollfleet.client.fully_async.FullyAsyncLLMServerClient", "partial_rollout": True},
        ),
    ],
)
async def test_every_worker_actor_runs_the_trainers_client(ray_session, tmp_path, mode, partial_rollout, expected):
    """The workers' clients are the trainer's ``get_llm_client()``, rebuilt in each actor: asked,
    every worker reports the mode's client class and its settings, and owns (closes) its copy."""
    # The simulated learner: the learner plays no part here.
    cfg = config(tmp_path, mode, partial_rollout=partial_rollout, **{"sim_learner.enabled": True})
    cfg.agent.num_workers = 2
    trainer = get_trainer_cls(mode)(cfg)
    try:
        await trainer.init()
        workers = trainer.agent_manager.workers
        assert len(workers) == 2 and all(w.remote for w in workers)
        infos = [await w.call("client_info") for w in workers]
    finally:
        await trainer.close()
    assert infos == [{**expected, "owns_client": True}] * 2


async def test_workers_run_whatever_get_llm_client_returns(ray_session, tmp_path):
    """``init`` hands the workers ``get_llm_client()``, not a class of its own choosing: a sync
    trainer whose ``get_llm_client`` returns a fully-async client gets fully-async workers."""

    class Custom(get_trainer_cls("sync")):
        def get_llm_client(self):
            return self.manager.get_client(client_cls=FullyAsyncLLMServerClient, partial_rollout=False)

    trainer = Custom(config(tmp_path, "sync", **{"sim_learner.enabled": True}))
    try:
        await trainer.init()
        infos = [await w.call("client_info") for w in trainer.agent_manager.workers]
    finally:
        await trainer.close()
    assert infos == [
        {
            "class": "rollfleet.client.fully_async.FullyAsyncLLMServerClient",
            "partial_rollout": False,
            "owns_client": True,
        }
    ]


async def test_separate_async_wait_holds_the_rollouter(ray_session, tmp_path):
    cfg = config(
        tmp_path,
        "separate_async",
        total_steps=4,
        max_off_policy_steps=1,
        max_off_policy_strategy="wait",
        max_inflight_groups=8,
        max_queue_groups=8,
    )
    trainer = await run(cfg)
    assert all(s <= 1 for entry in trainer.trained_log for s in entry["staleness"])
    assert trainer.tracker.history[-1]["rollout/waits"] > 0
    assert sum(r["staleness/dropped"] for r in trainer.tracker.history) == 0  # wait never drops
    assert trainer.tracker.history[-1]["staleness/over_bound_total"] == 0


async def test_no_trajectory_exceeds_response_length_across_syncs(ray_session, tmp_path):
    cfg = config(
        tmp_path, "separate_async", total_steps=6, max_off_policy_steps=3, max_inflight_groups=4, max_queue_groups=2
    )
    cfg.rollout.weight_sync.mode = "abort"  # syncs interrupt requests: they are resumed within the budget
    cfg.rollout.sim.time_scale = 0.2  # slow generation: syncs land mid-trajectory
    cfg.rollout.sim.mean_response_tokens = 200
    trainer = await run(cfg)
    assert all(e["max_response_len"] <= 12 for e in trainer.trained_log)
    assert sum(r["resumes"] for r in trainer.tracker.history) > 0


async def test_partial_rollout_off_regenerates_instead_of_training_on_truncated(ray_session, tmp_path, monkeypatch):
    cfg = config(
        tmp_path,
        "separate_async",
        total_steps=6,
        partial_rollout=False,
        max_off_policy_steps=3,
        max_inflight_groups=4,
        max_queue_groups=2,
    )
    cfg.rollout.sim.time_scale = 0.2
    cfg.rollout.sim.mean_response_tokens = 200
    trained: list = []
    train_on = Trainer._train_on

    async def recorded(self, groups):
        trained.extend(o for g in groups for o in g.outputs)
        return await train_on(self, groups)

    monkeypatch.setattr(Trainer, "_train_on", recorded)
    trainer = await run(cfg)
    assert trainer.step == 6
    assert trainer.tracker.history[-1]["rollout/regenerated"] > 0
    # Resumed only on the weights that sampled them (if at all): every trained response is whole
    # and one version's.
    assert trained and not any(was_aborted(o) or spans_versions(o) for o in trained)


async def test_resume_continues_step_count_and_reissues_inflight_prompts(ray_session, tmp_path):
    cfg = config(tmp_path, "separate_async", total_steps=3, save_freq=1, max_inflight_groups=6, max_queue_groups=6)
    first = await run(cfg)
    ckpts = tmp_path / "separate_async" / "checkpoints"
    state = json.loads((ckpts / (ckpts / "latest").read_text().strip() / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["inflight_task_indices"], state
    cfg2 = config(tmp_path, "separate_async", total_steps=5, resume=True, max_inflight_groups=6, max_queue_groups=6)
    second = await run(cfg2)
    assert [r["step"] for r in second.tracker.history][-2:] == [4, 5]
    trained = [i for e in second.trained_log for i in e["task_indices"]]
    assert set(state["inflight_task_indices"]) & set(trained), "re-issued prompts are trained first"
    assert second.version > first.version


async def test_a_fresh_run_in_an_earlier_runs_folder_resumes_from_its_own_checkpoints(ray_session, tmp_path):
    """A fresh run (``resume: false``) in the folder of an earlier, longer run: its checkpoints used
    to sit beside the earlier run's, so a resume of it found the earlier run's higher step and
    loaded that run's weights and data position (and the fresh run's pruning deleted its own)."""
    await run(config(tmp_path, "sync", total_steps=3, save_freq=1))
    await run(config(tmp_path, "sync", total_steps=1, save_freq=1))
    resumed = await run(config(tmp_path, "sync", total_steps=2, resume=True))
    assert [r["step"] for r in resumed.tracker.history] == [1, 2]  # on from the fresh run's step 1
    previous = tmp_path / "sync" / "checkpoints.previous"
    assert sorted(p.name for p in previous.glob("step_*")) == [f"step_0000000{i}" for i in (1, 2, 3)]


def config(tmp_path, mode: str, **trainer):
    """The shared job, with a longer tail of response lengths."""
    return sim_train_config(tmp_path, mode, {"sim.response_sigma": 1.2}, **trainer)
