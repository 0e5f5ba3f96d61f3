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


async def test_a_replica_slow_to_answer_does_not_hold_back_the_others_loads():
    """replica-2's ``load`` hangs (no round has noticed yet). The first view waits its 0.5 s at
    most, and gets the fresh loads of the others: it used to wait for all of them, time out, and
    keep the burst as load on replica-0."""
    faults = Faults()
    faults.hung_methods = {"load"}
    controller, replicas = fleet(config(probe_interval_s=60.0, probe_timeout_s=2.0), faults)
    await controller.launch(3)
    await burst_seen_then_over(controller, replicas["replica-0"])
    faults.hung.add("replica-2")
    balancer = GlobalRequestLoadBalancer({}, policy="least_inflight", seed=0)
    started = time.monotonic()
    await FleetView(balancer, controller=LocalHandle(controller)).refresh()
    assert time.monotonic() - started < 1.5
    assert balancer.get_status()["estimated_load"]["replica-0"] == 0
    faults.hung.clear()
    await controller.shutdown()


async def test_a_first_view_answer_does_not_undo_a_failed_round():
    """replica-1 answers a first view's query, asked before a round's probe of it failed, after
    that failure: the answer is a load, not a verdict; the replica stays suspect, its failure
    counted (it used to be made healthy again, its failures reset)."""
    faults = Faults()
    faults.hung_methods = {"load"}
    controller, replicas = fleet(config(probe_interval_s=60.0, probe_timeout_s=0.3, failures_to_dead=2), faults)
    await controller.launch(2)
    replica = replicas["replica-1"]
    answer = asyncio.Event()
    load = replica.load
    calls = []

    async def hung_then_slow():
        calls.append(1)
        if len(calls) == 1:  # the round's: hangs
            await asyncio.Event().wait()
        await answer.wait()  # the first view's: answered once the round has failed
        return await load()

    replica.load = hung_then_slow
    await asyncio.sleep(2 * FIRST_VIEW_LOAD_AGE_S)
    round_ = asyncio.ensure_future(controller.probe_all())
    await asyncio.sleep(0.1)
    view = asyncio.ensure_future(LocalHandle(controller).snapshot.remote(-1, client_id="c"))
    await round_
    record = controller._records["replica-1"]
    assert (record.state.value, record.consecutive_failures) == ("suspect", 1)
    answer.set()
    await view
    await asyncio.sleep(0.05)
    assert len(calls) == 2 and record.load is not None and record.load.inflight == 0  # the answer came
    assert (record.state.value, record.consecutive_failures) == ("suspect", 1)
    await controller.shutdown()
