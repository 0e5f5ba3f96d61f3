"""Membership changes that race with failures: a replica removed while it restarts, a removal whose
caller gives up, a replica that hangs while it joins under the update lock, a node table that does
not answer. In-process sim replicas, no Ray (the helpers of ``test_control_faults``)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from rollfleet.manager import supervision
from rollfleet.manager.controller import FleetController
from rollfleet.server.replica import Replica, ReplicaState
from tests.manager.test_control_faults import Faults, config, fleet, wait_until

pytestmark = pytest.mark.unit


def every_actor(controller: FleetController) -> list[tuple[str, Replica]]:
    """Record every replica actor the controller spawns, restarts included, in spawn order."""
    spawned: list[tuple[str, Replica]] = []
    make = controller._factory
    assert make is not None

    def recording(rid: str, index: int) -> Any:
        handle = make(rid, index)
        spawned.append((rid, handle.target))
        return handle

    controller._factory = recording
    return spawned


async def test_a_replica_removed_while_it_restarts_leaves_no_actor_running(monkeypatch):
    """replica-1 dies; its restart is stopping the dead actor (whose shutdown hangs, as a dead
    node's does) when the removal comes. The restart used to go on meanwhile and start a new
    actor, which the removal, stopping only the old one, left running with nobody to stop it."""
    monkeypatch.setattr(supervision, "STOP_TIMEOUT_DEAD_S", 0.2)
    faults = Faults()
    controller, _ = fleet(config(), faults)
    spawned = every_actor(controller)
    await controller.launch(2)
    old = dict(spawned)["replica-1"]
    gate = asyncio.Event()
    shutdowns = []
    stop_engine = old.shutdown

    async def hanging_shutdown() -> None:
        shutdowns.append(1)
        await gate.wait()
        await stop_engine()

    old.shutdown = hanging_shutdown  # type: ignore[method-assign]
    faults.dead_actors.append(old)  # the prober declares it dead and restarts it

    async def stopping(count: int) -> bool:
        return len(shutdowns) >= count

    await wait_until(lambda: stopping(1), "the restart stopping the dead actor")
    removal = asyncio.ensure_future(controller.remove_replicas(["replica-1"], drain_timeout_s=1.0))
    await wait_until(lambda: stopping(2), "the removal stopping the dead actor")
    await asyncio.sleep(0.6)  # the restart's stop of the old actor has timed out by now
    gate.set()
    assert await asyncio.wait_for(removal, 10) == ["replica-1"]
    await asyncio.sleep(0.3)
    actors = [replica for rid, replica in spawned if rid == "replica-1"]
    running = [replica._state for replica in actors if replica._state != ReplicaState.STOPPED]
    assert running == [], f"{len(actors)} actors of replica-1, these still running: {running}"
    assert "replica-1" not in (await controller.status()).replicas
    assert not controller._restart_tasks
    await controller.shutdown()


async def test_a_removal_whose_caller_gives_up_still_removes_the_replica():
    """A caller (an admin request that disconnects, a timeout) cancelled mid-drain used to leave
    the replica draining for good: unroutable, never stopped, still a member."""
    faults = Faults()
    controller, replicas = fleet(config(), faults)
    await controller.launch(2)
    busy = replicas["replica-1"]
    report = busy.load

    async def always_busy() -> Any:
        return dataclasses.replace(await report(), inflight=1)

    busy.load = always_busy  # type: ignore[method-assign]  # the drain waits its whole timeout
    removal = asyncio.ensure_future(controller.remove_replicas(["replica-1"], drain_timeout_s=0.8))
    await asyncio.sleep(0.2)
    removal.cancel()
    with pytest.raises(asyncio.CancelledError):
        await removal

    async def removed() -> bool:
        return "replica-1" not in (await controller.status()).replicas

    await wait_until(removed, "replica-1 removed after its caller gave up", timeout_s=5)
    assert busy._state == ReplicaState.STOPPED
    assert (await controller.snapshot()).routable_ids() == ["replica-0"]
    await controller.shutdown()


@pytest.mark.parametrize("hang", ["pause", "weights_checksum"])
async def test_a_replica_hanging_as_it_joins_does_not_hold_up_the_trainers_update(hang):
    """replica-1 restarts into a paused fleet that has verified weights; its new actor hangs in
    the last calls of its start (bringing it to the fleet's pause, or checking its weights), made
    under the update lock. The trainer's next update used to wait for the lock until the start
    timed out (``health.start_timeout_s``, 30 s here); now that call fails within
    ``health.control_timeout_s`` (0.5 s), the start is tried again, and the update goes on."""
    faults = Faults()
    controller, replicas = fleet(config(start_timeout_s=30.0), faults)
    spawned = every_actor(controller)
    await controller.launch(2)
    await controller.update_weights({"step": 1}, 1)  # the fleet now has a weights digest to check
    await controller.pause()
    faults.hung_methods = {hang}
    faults.hung.add("replica-1")  # its restarts hang in ``hang`` (the old actor is not asked again)
    faults.dead_actors.append(replicas["replica-1"])

    async def restarted() -> bool:
        return sum(rid == "replica-1" for rid, _ in spawned) >= 2

    await wait_until(restarted, "replica-1 restarting")
    await asyncio.sleep(0.1)  # in its start's last calls by now (the sim engine starts at once)
    report = await asyncio.wait_for(controller.update_weights({"step": 2}, 2), 5.0)
    assert report["version"] == 2 and report["replicas"] == 1
    faults.hung.clear()

    async def back_on_version_2() -> bool:
        status = (await controller.status()).replicas["replica-1"]
        return status.state == "healthy" and status.weight_version == 2

    await wait_until(back_on_version_2, "replica-1 back on version 2")
    assert replicas["replica-1"]._state == ReplicaState.PAUSED
    await controller.shutdown()


class StalledNodeTable:
    """A placer whose node query never returns (Ray's GCS stalled) and that places nothing."""

    def __init__(self) -> None:
        self.placements: dict[str, Any] = {}
        self.queries = 0

    async def dead_nodes(self) -> set[str]:
        self.queries += 1
        await asyncio.Event().wait()
        return set()

    async def reserve(self, rid: str, fraction: float) -> None:
        return None

    def release(self, rid: str) -> None:
        pass

    def release_all(self) -> None:
        pass


async def test_a_stalled_node_table_does_not_stop_the_probes():
    """Each probe round asks Ray which nodes died before it probes the replicas; a query that
    never returned used to stop every round there, so a dead replica was never found out."""
    faults = Faults()
    controller, replicas = fleet(config(), faults)
    await controller.launch(2)
    nodes = StalledNodeTable()
    controller._placer = nodes  # type: ignore[assignment]
    first = replicas["replica-1"]
    faults.dead_actors.append(first)

    async def restarted() -> bool:
        status = (await controller.status()).replicas["replica-1"]
        return status.restarts == 1 and status.state == "healthy"

    await wait_until(restarted, "replica-1 found dead and restarted")
    assert replicas["replica-1"] is not first
    assert nodes.queries == 1  # the rounds wait on the one query, they do not start one each
    await controller.shutdown()
