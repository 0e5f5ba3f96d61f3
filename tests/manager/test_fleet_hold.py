"""A fleet paused or put to sleep by its owner (a colocated learner holds the devices) stays so
until resumed: neither a replica restarted meanwhile nor an ``abort``-mode weight commit sets it
generating again. In-process sim replicas, no Ray (the helpers of ``test_control_faults``)."""

from __future__ import annotations

import asyncio

import pytest

from rollfleet.errors import NotSupported
from rollfleet.server.replica import Replica, ReplicaState
from tests.manager.test_control_faults import Faults, config, fleet, wait_until

pytestmark = pytest.mark.unit


async def test_a_replica_restarted_while_the_fleet_is_paused_comes_back_paused():
    faults = Faults()
    controller, replicas = fleet(config(), faults)
    await controller.launch(2)
    faults.dead.add("replica-1")  # its pause fails: fenced, then restarted
    report = await controller.pause()
    assert list(report["fenced"]) == ["replica-1"]
    faults.dead.clear()

    async def healthy() -> bool:
        return "replica-1" in (await controller.snapshot()).routable_ids()

    await wait_until(healthy, "replica-1 restarted")
    restarted = replicas["replica-1"]
    assert restarted._state == ReplicaState.PAUSED  # it used to come back serving
    held = asyncio.ensure_future(restarted.generate("r", [1, 2, 3], {"max_tokens": 4}))
    await asyncio.sleep(0.2)
    assert not held.done()
    await controller.resume()
    assert len((await asyncio.wait_for(held, 5)).token_ids) > 0
    await controller.shutdown()


async def test_a_replica_that_dies_while_the_fleet_sleeps_comes_back_asleep():
    faults = Faults()
    controller, replicas = fleet(config(), faults)
    await controller.launch(2)
    await controller.pause()
    await controller.sleep()
    old = replicas["replica-1"]
    faults.dead.add("replica-1")  # its probes fail: declared dead, restarted
    await wait_until(lambda: _restarted(replicas, old, faults), "replica-1 replaced")

    async def healthy() -> bool:
        return "replica-1" in (await controller.snapshot()).routable_ids()

    await wait_until(healthy, "replica-1 restarted")
    assert replicas["replica-1"]._state == ReplicaState.SLEEPING
    await controller.wake_up()
    await controller.resume()
    assert {r._state for r in replicas.values()} == {ReplicaState.SERVING}
    await controller.shutdown()


async def _restarted(replicas: dict, old: object, faults: Faults) -> bool:
    if replicas["replica-1"] is old:
        return False
    faults.dead.clear()  # the new actor is sound
    return True


async def test_an_abort_commit_leaves_a_paused_fleet_paused():
    controller, replicas = fleet(config(), Faults())
    await controller.launch(2)
    await controller.pause()
    await controller.update_weights({"step": 1}, 1, mode="abort")
    assert {r._state for r in replicas.values()} == {ReplicaState.PAUSED}  # the commit used to resume them
    await controller.resume()
    assert {r._state for r in replicas.values()} == {ReplicaState.SERVING}
    await controller.update_weights({"step": 2}, 2, mode="abort")  # serving before: serving after
    assert {r._state for r in replicas.values()} == {ReplicaState.SERVING}
    await controller.shutdown()


async def test_resuming_a_sleeping_replica_wakes_it_first():
    controller, replicas = fleet(config(), Faults())
    await controller.launch(1)
    await controller.pause()
    await controller.sleep()
    await controller.resume()  # no wake_up: it served asleep, and a request hung
    out = await asyncio.wait_for(replicas["replica-0"].generate("r", [1, 2, 3], {"max_tokens": 4}), 5)
    assert len(out.token_ids) > 0
    await controller.shutdown()


async def test_an_abort_commit_that_fails_to_load_leaves_the_replica_paused():
    """Its weights may be half loaded: it must not generate on them (it was resumed in a finally)."""
    controller, replicas = fleet(config(), Faults())
    await controller.launch(1)
    replica = replicas["replica-0"]

    async def broken(version: int, mode: str) -> None:
        raise RuntimeError("load failed half way (injected)")

    await replica.stage_weights({"step": 1}, 1)
    replica.engine.commit_weights = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="half way"):
        await replica.commit_weights(1, "abort")
    assert replica._state == ReplicaState.PAUSED and replica._version != 1
    await controller.shutdown()


def _slow_commit(replica: Replica, loading: asyncio.Event, release: asyncio.Event) -> None:
    """The engine's commit waits for ``release`` once it started loading (a large model's load)."""
    engine = replica.engine
    commit = engine.commit_weights

    async def slow(version: int, mode: str) -> None:
        loading.set()
        await release.wait()
        await commit(version, mode)

    engine.commit_weights = slow  # type: ignore[method-assign]


async def test_a_pause_that_lands_while_an_abort_commit_loads_is_kept():
    """Both said PAUSED, so the pause changed nothing and the commit resumed the replica."""
    controller, replicas = fleet(config(commit_timeout_s=5.0), Faults())
    await controller.launch(1)
    replica = replicas["replica-0"]
    loading, release = asyncio.Event(), asyncio.Event()
    _slow_commit(replica, loading, release)
    update = asyncio.ensure_future(controller.update_weights({"step": 1}, 1, mode="abort"))
    await asyncio.wait_for(loading.wait(), 5)
    await controller.pause()  # the learner takes the devices while the weights load
    release.set()
    await update
    assert replica._state == ReplicaState.PAUSED and replica._version == 1
    held = asyncio.ensure_future(replica.generate("r", [1, 2, 3], {"max_tokens": 4}))
    await asyncio.sleep(0.2)
    assert not held.done()
    await controller.resume()
    assert len((await asyncio.wait_for(held, 5)).token_ids) > 0
    await controller.shutdown()


async def test_a_resume_that_lands_while_an_abort_commit_loads_waits_for_the_weights():
    """It used to open the gate at once: requests ran on half-loaded weights under the old label."""
    controller, replicas = fleet(config(commit_timeout_s=5.0), Faults())
    await controller.launch(1)
    await controller.pause()
    replica = replicas["replica-0"]
    loading, release = asyncio.Event(), asyncio.Event()
    _slow_commit(replica, loading, release)
    update = asyncio.ensure_future(controller.update_weights({"step": 1}, 1, mode="abort"))
    await asyncio.wait_for(loading.wait(), 5)
    await controller.resume()
    held = asyncio.ensure_future(replica.generate("r", [1, 2, 3], {"max_tokens": 4}))
    await asyncio.sleep(0.2)
    assert replica._state == ReplicaState.PAUSED and not held.done()
    release.set()
    await update
    assert replica._state == ReplicaState.SERVING  # the owner asked: it serves once the weights are in
    out = await asyncio.wait_for(held, 5)
    assert set(out.token_versions) == {1}
    await controller.shutdown()


async def test_a_sleep_the_engines_refuse_leaves_the_fleets_hold_as_it_was():
    """vLLM's CPU build cannot sleep: the fleet stays paused, and a replica restarted then comes
    back paused (it was brought to 'sleeping': on vLLM CPU its start failed on the refusal)."""
    faults = Faults()
    controller, replicas = fleet(config(), faults)
    await controller.launch(2)
    await controller.pause()
    for replica in replicas.values():
        replica.engine.sleep = _refuse_sleep  # type: ignore[method-assign]
    with pytest.raises(NotSupported):
        await controller.sleep()
    assert controller._hold == "paused"
    old = replicas["replica-1"]
    faults.dead.add("replica-1")
    await wait_until(lambda: _restarted(replicas, old, faults), "replica-1 replaced")

    async def healthy() -> bool:
        return "replica-1" in (await controller.snapshot()).routable_ids()

    await wait_until(healthy, "replica-1 restarted")
    assert replicas["replica-1"]._state == ReplicaState.PAUSED  # it was put to sleep
    await controller.shutdown()


async def _refuse_sleep() -> None:
    raise NotSupported("vllm", "sleep")
