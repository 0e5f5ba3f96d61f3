"""Membership changes that race with failures: a replica removed while it restarts, a removal whose
caller gives up, a replica that hangs while it joins under the update lock, a node table that does
not answer. In-process sim replicas, no Ray (the helpers of ``test_control_faults``)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from rollfleet.errors import FleetShutDown, InsufficientResources
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

    async def told_why() -> bool:  # the call's own limit, not "start took over start_timeout_s"
        detail = (await controller.status()).replicas["replica-1"].detail
        return f"{hang} on starting replica-1 took over 0.5s" in detail

    await wait_until(told_why, "replica-1's start failing on the hung call's own limit")
    faults.hung.clear()

    async def back_on_version_2() -> bool:
        status = (await controller.status()).replicas["replica-1"]
        return status.state == "healthy" and status.weight_version == 2

    await wait_until(back_on_version_2, "replica-1 back on version 2")
    assert replicas["replica-1"]._state == ReplicaState.PAUSED
    await controller.shutdown()


class FakePlacer:
    """A placer that places nothing (the replicas are in-process) and records what it is asked:
    its node query may never return (Ray's GCS stalled), its reservation may wait for devices."""

    def __init__(self, stall_nodes: bool = False, block_reserve: bool = False) -> None:
        self.placements: dict[str, Any] = {}
        self.stall_nodes, self.block_reserve = stall_nodes, block_reserve
        self.queries = 0
        self.reserving = asyncio.Event()
        self.reservation_cancelled = False
        self.released: list[str] = []
        self.capacity_asked: list[int] = []

    async def check_capacity(self, total: int, field_name: str, adding: Any = None) -> None:
        self.capacity_asked.append(total)

    async def dead_nodes(self) -> set[str]:
        self.queries += 1
        if self.stall_nodes:
            await asyncio.Event().wait()
        return set()

    async def reserve(self, rid: str, fraction: float) -> None:
        if self.block_reserve:  # no devices free: Placer._create_group waits on pg.ready()
            self.reserving.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.reservation_cancelled = True  # where the real one removes its pending group
                raise
        return None

    def release(self, rid: str) -> None:
        self.released.append(rid)

    def release_all(self) -> None:
        self.released.append("*")


async def test_a_stalled_node_table_does_not_stop_the_probes():
    """Each probe round asks Ray which nodes died before it probes the replicas; a query that
    never returned used to stop every round there, so a dead replica was never found out."""
    faults = Faults()
    controller, replicas = fleet(config(), faults)
    await controller.launch(2)
    nodes = FakePlacer(stall_nodes=True)
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


async def test_a_shutdown_during_a_launch_stops_the_reservation_still_waiting_for_devices():
    """Shut down while a launch waits for devices (another job holds them): the launch used to go
    on, its placement group pending, and take the devices, and start a replica, once they freed."""
    controller, _ = fleet(config(), Faults())
    placer = FakePlacer(block_reserve=True)
    controller._placer = placer  # type: ignore[assignment]
    launch = asyncio.ensure_future(controller.launch(2))
    await asyncio.wait_for(placer.reserving.wait(), 5)
    await asyncio.wait_for(controller.shutdown(), 5)
    assert placer.reservation_cancelled  # before shutdown() returned
    with pytest.raises(FleetShutDown):
        await launch
    with pytest.raises(FleetShutDown):
        await controller.add_replicas(1)
    assert not (await controller.status()).replicas


async def test_a_replica_given_up_on_gives_its_devices_back():
    """After ``health.max_restart_attempts`` a replica stays dead, visibly, and nothing revisits
    it: its placement group used to keep its devices until the fleet shut down. A replica added
    then may have them: the capacity check used to count the dead one as still holding its share."""
    faults = Faults()
    controller, replicas = fleet(config(max_restart_attempts=1), faults)
    await controller.launch(2)
    placer = FakePlacer()
    controller._placer = placer  # type: ignore[assignment]
    faults.failed_starts["replica-1"] = 99
    faults.dead_actors.append(replicas["replica-1"])

    async def given_up() -> bool:
        return "gave up" in (await controller.status()).replicas["replica-1"].detail

    await wait_until(given_up, "replica-1 given up on")
    assert placer.released == ["replica-1"]
    await controller.add_replicas(1)
    assert placer.capacity_asked == [2]  # replica-0 and the new one, not the one given up on
    await controller.shutdown()


async def test_a_learner_made_again_goes_to_the_device_reserved_for_the_first():
    """Each call of ``learner_placement`` (a learner made again after a failure) reserved one
    more device for the learner, held until the fleet shut down."""
    controller, _ = fleet(config(), Faults())
    await controller.launch(1)
    reserved: list[object] = []

    class Devices(FakePlacer):
        async def device(self) -> str:
            return "gpu"

        async def reserve_worker(self, name: str) -> object:
            await asyncio.sleep(0.01)
            reserved.append(object())
            return reserved[-1]

    controller._placer = Devices()  # type: ignore[assignment]
    first, again, at_once = await asyncio.gather(*(controller.learner_placement() for _ in range(3)))
    assert len(reserved) == 1 and first is again is at_once is reserved[0]
    controller._learner_group = None  # released by shutdown() through Ray otherwise: none here
    await controller.shutdown()


async def test_a_shutdown_during_a_start_returns_once_the_starting_replica_is_stopped():
    """The launch's own clean-up used to take the starting replica's record as shutdown()
    cancelled it: shutdown() found nothing to stop and returned while the engine still stopped
    (and the caller then killed the controller, cutting that stop short)."""
    controller, replicas = fleet(config(), Faults())
    make = controller._factory
    assert make is not None

    def slow_to_start_and_stop(rid: str, index: int) -> Any:
        handle = make(rid, index)
        replica, stop_engine = handle.target, handle.target.shutdown

        async def hangs(*args: Any, **kwargs: Any) -> None:
            await asyncio.Event().wait()

        async def slow_stop() -> None:
            await asyncio.sleep(0.5)
            await stop_engine()

        replica.start, replica.shutdown = hangs, slow_stop
        return handle

    controller._factory = slow_to_start_and_stop
    launch = asyncio.ensure_future(controller.launch(1))
    await asyncio.sleep(0.1)
    await controller.shutdown()
    assert replicas["replica-0"]._state == ReplicaState.STOPPED
    with pytest.raises(FleetShutDown):
        await launch
    assert controller._probe_task is None  # and no prober started for a fleet that is shut down


async def test_a_colocated_learners_replica_given_up_on_keeps_its_devices():
    """Its placement group also holds the learner: released, it took the learner with it."""
    faults = Faults()
    controller, replicas = fleet(config(max_restart_attempts=1), faults)
    await controller.launch(2)
    placer = FakePlacer()
    controller._placer = placer  # type: ignore[assignment]
    controller._learner_host = "replica-0"  # what learner_placement() notes under placement.colocate
    faults.failed_starts["replica-0"] = 99
    faults.dead_actors.append(replicas["replica-0"])

    async def given_up() -> bool:
        return "gave up" in (await controller.status()).replicas["replica-0"].detail

    await wait_until(given_up, "replica-0 given up on")
    assert placer.released == []
    await controller.shutdown()


class _RoomFor:
    """A placer over a cluster with room for ``room`` replicas; its capacity check asks the cluster
    (an await, as Ray's node table is), and reservations place nothing (in-process replicas)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.placements: dict[str, Any] = {}

    async def check_capacity(self, total: int, field_name: str, adding: Any = None) -> None:
        await asyncio.sleep(0.01)
        if total > self.room:
            raise InsufficientResources(field_name, f"{total} replicas", f"room for {self.room}")

    async def reserve(self, rid: str, fraction: float) -> None:
        return None

    async def dead_nodes(self) -> set[str]:
        return set()

    def release(self, rid: str) -> None: ...

    def release_all(self) -> None: ...


async def test_two_add_replicas_at_once_count_each_others_starts():
    """Starts in progress have no record yet: each call counted only the replicas already placed,
    both passed the check, and the cluster ran out of room half way through one of them."""
    controller, replicas = fleet(config(), Faults())
    controller._placer = _RoomFor(4)  # type: ignore[assignment]
    await controller.launch(2)
    first, second = await asyncio.gather(controller.add_replicas(2), controller.add_replicas(2), return_exceptions=True)
    assert isinstance(first, list) and len(first) == 2
    assert isinstance(second, InsufficientResources) and second.field == "add_replicas(n)"
    assert "6 replicas" in str(second)  # the 2 serving, the 2 starting and these 2
    assert len((await controller.snapshot()).routable_ids()) == 4 and len(replicas) == 4  # nothing else started
    await controller.shutdown()


async def test_a_removal_with_arguments_it_cannot_use_touches_no_replica():
    """A drain timeout of None failed only after the replicas were marked draining: they stayed
    so (never probed, never restarted, unroutable) and kept their devices. A bare id removed its
    characters (nothing), or failed with an unrelated TypeError."""
    from rollfleet.errors import InvalidRequest

    controller, _ = fleet(config(), Faults())
    await controller.launch(2)
    for ids, timeout, field in (
        (["replica-1"], None, "drain_timeout_s"),
        (["replica-1"], "5", "drain_timeout_s"),
        (["replica-1"], float("nan"), "drain_timeout_s"),
        (["replica-1"], -1.0, "drain_timeout_s"),
        ("replica-1", 1.0, "replica_ids"),
        ([1], 1.0, "replica_ids"),
    ):
        with pytest.raises(InvalidRequest) as err:
            await controller.remove_replicas(ids, drain_timeout_s=timeout)  # type: ignore[arg-type]
        assert err.value.field == field, (ids, timeout)
    states = {rid: r.state.value for rid, r in controller._records.items()}
    assert states == {"replica-0": "healthy", "replica-1": "healthy"}
    assert await controller.remove_replicas(["replica-1"], drain_timeout_s=0.5) == ["replica-1"]
    await controller.shutdown()
