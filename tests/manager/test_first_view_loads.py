"""A client's first snapshot carries loads asked for afresh, not the last probe round's: right
after another client's burst, the round's loads still count that burst, and a new client takes
whatever is not its own as others' load until its next refresh. In-process sim replicas, no Ray
(the helpers of ``test_control_faults``)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from rollfleet.client.fleet_view import FleetView
from rollfleet.manager.supervision import FIRST_VIEW_LOAD_AGE_S
from rollfleet.routing import GlobalRequestLoadBalancer
from rollfleet.server.local import LocalHandle
from tests.manager.test_control_faults import Faults, config, fleet, wait_until

pytestmark = pytest.mark.unit

BURST = 12


async def burst_seen_then_over(controller, replica) -> None:
    """``BURST`` requests on ``replica``, counted by a probe round, then finished."""
    requests = [
        asyncio.ensure_future(replica.generate(f"burst-{i}", [1, 2, 3], {"max_tokens": 24, "ignore_eos": True}))
        for i in range(BURST)
    ]

    async def all_running() -> bool:
        return (await replica.load()).inflight == BURST

    await wait_until(all_running, "the burst running")
    await controller.probe_all()
    assert controller._records[replica.replica_id].load.inflight == BURST
    await asyncio.gather(*requests)
    await asyncio.sleep(2 * FIRST_VIEW_LOAD_AGE_S)  # the client comes a moment later


async def test_a_new_client_does_not_take_a_finished_burst_for_load():
    """12 requests on replica-0, seen by the last round and finished since: a new client used to
    route its first 8 requests all to replica-1 (12 phantom requests on replica-0)."""
    controller, replicas = fleet(config(probe_interval_s=60.0), Faults())  # no round during the test
    await controller.launch(2)
    await burst_seen_then_over(controller, replicas["replica-0"])
    balancer = GlobalRequestLoadBalancer({}, policy="least_inflight", seed=0)
    await FleetView(balancer, controller=LocalHandle(controller)).refresh()
    placed = Counter(balancer.acquire_server(f"new-{i}")[0] for i in range(8))
    assert placed == {"replica-0": 4, "replica-1": 4}
    await controller.shutdown()


async def test_clients_starting_together_share_one_probe_and_later_views_ask_none():
    controller, replicas = fleet(config(probe_interval_s=60.0), Faults())
    await controller.launch(2)
    await burst_seen_then_over(controller, replicas["replica-0"])
    asked = Counter()
    for rid, replica in replicas.items():
        load = replica.load

        async def counted(_rid=rid, _load=load):
            asked[_rid] += 1
            return await _load()

        replica.load = counted
    handle = LocalHandle(controller)
    snapshots = await asyncio.gather(*(handle.snapshot.remote(-1, client_id=f"c{i}") for i in range(20)))
    assert {s.loads["replica-0"].inflight for s in snapshots} == {0}
    assert asked == {"replica-0": 1, "replica-1": 1}
    first = snapshots[0]
    await handle.snapshot.remote(first.membership_epoch, client_id="c0")  # a client's later refresh
    await handle.watch.remote(first.membership_epoch, first.signature(), 0.05, client_id="c0")
    assert asked == {"replica-0": 1, "replica-1": 1}
    await controller.shutdown()


async def test_a_hung_replica_is_found_dead_while_clients_keep_starting():
    """Clients starting one after another ask for fresh loads all the time; a replica whose
    ``load`` hangs must still be judged by the probe rounds (a first view that marked its probe as
    the one in flight made every round skip that replica)."""
    faults = Faults()
    faults.hung_methods = {"load"}
    controller, _ = fleet(config(probe_interval_s=0.05, probe_timeout_s=0.2, failures_to_dead=2), faults)
    await controller.launch(2)
    faults.hung.add("replica-1")
    await asyncio.sleep(2 * FIRST_VIEW_LOAD_AGE_S)  # the loads from its start are old enough to ask again
    handle = LocalHandle(controller)
    states = []
    deadline = time.monotonic() + 5.0  # 2 failed rounds take 0.5 s
    while time.monotonic() < deadline:  # a client starts as soon as the last one has its view
        snapshot = await handle.snapshot.remote(-1, client_id=f"c{len(states)}")
        states.append(snapshot.states["replica-1"])
        if states[-1] not in ("healthy", "suspect"):
            break
    assert states[-1] not in ("healthy", "suspect"), f"replica-1 still {states[-1]} after {len(states)} clients"
    await controller.shutdown()
