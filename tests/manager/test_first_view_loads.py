"""A client's first snapshot carries loads asked for afresh, not the last probe round's: right
after another client's burst, the round's loads still count that burst, and a new client takes
whatever is not its own as others' load until its next refresh. In-process sim replicas, no Ray
(the helpers of ``test_control_faults``)."""

from __future__ import annotations

import asyncio
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
