"""The learner in a Ray actor of its own: the driver only drives (sim engine, single node).

Where a placement puts it on a multi-node cluster is tested in tests/manager/cluster.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from trainer_support import sim_train_config as config

from rollfleet.trainer import get_trainer_cls
from rollfleet.trainer.config import SimLearnerConfig
from rollfleet.trainer.remote_learner import (
    LearnerHost,
    LearnerSpec,
    RemoteLearner,
    torch_threads,
)


def spy(manager, calls: list, *names: str) -> None:
    """Record the control calls the trainer makes on the fleet (and what update_weights gets)."""
    for name in names:
        orig = getattr(manager, name)

        async def wrapped(*args, _name=name, _orig=orig, **kwargs):
            calls.append((_name, type(args[0]) if _name == "update_weights" else None))
            return await _orig(*args, **kwargs)

        setattr(manager, name, wrapped)


# ---------------------------------------------------------------------- without Ray
@pytest.mark.unit
def test_torch_threads_follow_the_gpu_reservation_and_all_cores_without_one():
    assert torch_threads({"GPU": 0.5, "CPU": 4.0}, cores=16) == 4
    assert torch_threads({"GPU": 0.5, "CPU": 0.5}, cores=16) == 1  # Ray's floor, at least 1
    assert torch_threads({"CPU": 0.5}, cores=16) == 16  # CPU learner: not single-threaded by Ray's default
    assert torch_threads({}, cores=16) == 16


@pytest.mark.unit
def test_learner_host_builds_from_a_picklable_spec_and_forwards(tmp_path):
    import pickle

    spec = pickle.loads(pickle.dumps(LearnerSpec("sim", SimLearnerConfig(enabled=True, seconds_per_token=0))))
    host = LearnerHost(spec)
    batch = SimpleNamespace(response_mask=torch.ones(2, 3))
    assert host.update(batch)["actor/global_step"] == 1.0
    assert host.state_dict_for_inference() == {"sim_step": 1}
    host.save(str(tmp_path), {"step": 1})
    assert LearnerHost(spec).load(str(tmp_path)) == {"step": 1}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("mode", "override", "expected"),
    [
        ("sync", None, True),
        ("colocate_async", None, True),
        ("separate_async", None, False),
        ("separate_async", True, True),
        ("sync", False, False),
    ],
)
def test_colocation_is_the_modes_default_unless_configured(tmp_path, mode, override, expected):
    cfg = config(tmp_path, mode, **({} if override is None else {"colocate": override}))
    trainer = get_trainer_cls(mode)(cfg)
    assert trainer.config.rollout.placement.colocate is expected
    assert cfg.rollout.placement.colocate is False  # the caller's config is left alone


# ---------------------------------------------------------------------- on the session's cluster
@pytest.mark.ray
async def test_sim_learner_runs_in_its_own_process_and_the_trainer_still_trains(ray_session, tmp_path):
    cfg = config(tmp_path, "sync", **{"sim_learner.enabled": True})
    trainer = get_trainer_cls("sync")(cfg)
    calls: list = []
    try:
        await trainer.init()
        where = await trainer.learner.where()
        spy(trainer.manager, calls, "pause", "sleep", "wake_up", "resume", "update_weights")
        await trainer.fit()
        fleet_version = (await trainer.manager.status()).current_version
        handle = trainer.learner.handle
    finally:
        await trainer.close()
    assert where["pid"] != os.getpid() and where["node_id"] == ray_session.get_runtime_context().get_node_id()
    assert where["resources"].get("CPU", 0) == 0  # the sim fleet reserves nothing: neither does the learner
    assert trainer.version == trainer.syncs == 3 == fleet_version
    rows = trainer.tracker.history
    assert [r["actor/global_step"] for r in rows] == [1.0, 2.0, 3.0]  # metrics come back from the actor
    # sync: the fleet sleeps while the learner trains and wakes before the weights load.
    step = [
        ("pause", None),
        ("sleep", None),
        ("wake_up", None),
        ("update_weights", ray_session.ObjectRef),
        ("resume", None),
    ]
    assert calls == step * 3
    with pytest.raises(ray_session.exceptions.RayActorError):
        await handle.where.remote()  # close() killed the learner


@pytest.mark.ray
async def test_torch_learner_pushes_an_object_ref_and_resumes_from_its_checkpoint(ray_session, tmp_path):
    cfg = config(tmp_path, "separate_async", total_steps=2)
    trainer = get_trainer_cls("separate_async")(cfg)
    calls: list = []
    try:
        await trainer.init()
        where = await trainer.learner.where()
        spy(trainer.manager, calls, "update_weights")
        await trainer.fit()
    finally:
        await trainer.close()
    assert where["pid"] != os.getpid()
    assert where["torch_threads"] == len(os.sched_getaffinity(0))  # not Ray's OMP_NUM_THREADS=1
    assert calls == [("update_weights", ray_session.ObjectRef)] * 2
    assert [r["step"] for r in trainer.tracker.history] == [1, 2]
    assert all("actor/pg_loss" in r for r in trainer.tracker.history)

    # The actor wrote the checkpoint; a new learner actor loads it and pushes it as an ObjectRef.
    resumed = get_trainer_cls("separate_async")(config(tmp_path, "separate_async", total_steps=2, resume=True))
    try:
        await resumed.init()
        assert resumed.step == 2 and resumed.version == 3
    finally:
        await resumed.close()


@pytest.mark.ray
async def test_a_placement_gives_the_actor_its_options(ray_session):
    placement = SimpleNamespace(actor_options=lambda: {"num_cpus": 1, "resources": {}})
    learner = await RemoteLearner.create(LearnerSpec("sim", SimLearnerConfig(enabled=True)), placement)
    try:
        assert learner.info["resources"].get("CPU") == 1.0
        assert (await learner.where())["pid"] == learner.info["pid"]
    finally:
        learner.kill()
