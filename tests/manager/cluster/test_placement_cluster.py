"""Placement on a real 3-node Ray cluster with fake GPUs (see conftest.py), sim engine.

What a user with a GPU cluster relies on: every replica reserves its devices in a placement group
on one node, the engine is told exactly those devices, replicas spread or pack across nodes as
configured, the learner shares or avoids the replicas' devices, a dead node's replicas resume
elsewhere without losing work, and asking for more than the cluster has fails fast and clearly.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Optional

import pytest
from conftest import CPUS_PER_NODE, GPUS_PER_NODE, alive_node_ids

from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.config import RollfleetConfig
from rollfleet.errors import InsufficientResources, InvalidRequest
from rollfleet.manager import LLMServerManager

pytestmark = [pytest.mark.ray, pytest.mark.cluster]


def sim_config(num_replicas: int, tp: int = 2, time_scale: float = 50.0, **placement) -> RollfleetConfig:
    return RollfleetConfig.model_validate(
        {
            "rollout": {
                "name": "sim",
                "num_replicas": num_replicas,
                "prompt_length": 32,
                "response_length": 64,
                "max_model_len": 128,
                "sim": {
                    "vocab_size": 500,
                    "tensor_parallel_size": tp,
                    "time_scale": time_scale,
                    "mean_response_tokens": 30,
                },
                "placement": {"timeout_s": 10.0, "pending_retry_s": 0.5, **placement},
                "health": {"probe_interval_s": 0.5, "probe_timeout_s": 3.0},
                "retry": {"max_attempts": 64, "initial_backoff_s": 0.02, "max_backoff_s": 0.2},
            }
        }
    )


def pg_bundle_nodes(pg) -> set[str]:
    from ray.util.placement_group import placement_group_table

    return set(placement_group_table(pg)["bundles_to_node_id"].values())


async def test_tp2_replicas_get_distinct_devices_on_one_node_each_and_spread_covers_all_nodes(cluster):
    manager = await LLMServerManager.create(sim_config(6, strategy="SPREAD"))
    try:
        replicas = await manager.get_replicas()
        pairs = [(r.node_id, d) for r in replicas for d in r.devices]
        assert len(pairs) == 12 and len(set(pairs)) == 12, pairs  # every GPU of the cluster, once
        assert all(len(r.devices) == 2 for r in replicas)
        assert {r.node_id for r in replicas} == set(alive_node_ids())
        assert Counter(r.node_id for r in replicas) == Counter({n: 2 for n in alive_node_ids()})
        stats = await manager.replica_stats()
        placements = await manager.controller.replica_placements.remote()
        for r in replicas:
            # Ray put both bundles of the replica's group on the node the fleet reports ...
            assert pg_bundle_nodes(placements[r.replica_id].pg) == {r.node_id}
            # ... and the engine was started with exactly the ids Ray assigned to those bundles.
            assert stats[r.replica_id]["engine_devices"] == r.devices
            assert r.node_ip == "127.0.0.1"
        status = await manager.status()
        assert all(s.devices and s.node_id for s in status.replicas.values())
    finally:
        await manager.shutdown()


async def test_pack_fills_a_node_before_opening_the_next(cluster):
    manager = await LLMServerManager.create(sim_config(3, strategy="PACK"))
    try:
        per_node = Counter(r.node_id for r in await manager.get_replicas())
        assert sorted(per_node.values()) == [1, 2]  # 2 replicas x 2 GPUs fill one node, then the next
    finally:
        await manager.shutdown()
    manager = await LLMServerManager.create(sim_config(3, strategy="SPREAD"))
    try:
        assert sorted(Counter(r.node_id for r in await manager.get_replicas()).values()) == [1, 1, 1]
    finally:
        await manager.shutdown()


async def test_strict_spread_puts_one_replica_per_node_and_refuses_a_fourth(cluster):
    manager = await LLMServerManager.create(sim_config(3, strategy="STRICT_SPREAD"))
    try:
        assert len({r.node_id for r in await manager.get_replicas()}) == 3
        with pytest.raises(InsufficientResources) as err:
            await manager.add_replicas(1)
        assert err.value.field == "add_replicas(n)"
    finally:
        await manager.shutdown()


async def learner_probe(manager, keep: Optional[list] = None):
    """An actor placed where the fleet says the learner goes; returns (node id, GPU ids). The
    actor goes into ``keep`` when given (else it is gone with its handle)."""
    import ray

    @ray.remote
    class Probe:
        def where(self):
            ctx = ray.get_runtime_context()
            return ctx.get_node_id(), list(ctx.get_accelerator_ids().get("GPU", []))

    placement = await manager.learner_placement()
    probe = Probe.options(**placement.actor_options()).remote()
    if keep is not None:
        keep.append(probe)
    return await probe.where.remote()


async def test_colocated_learner_shares_the_first_replicas_device(cluster):
    """...and that replica cannot be removed: its placement group going would kill the learner."""
    manager = await LLMServerManager.create(sim_config(2, colocate=True))
    try:
        first, second = await manager.get_replicas()
        learner: list = []
        node, gpus = await learner_probe(manager, keep=learner)
        assert node == first.node_id and gpus == first.devices[:1]
        with pytest.raises(InvalidRequest) as err:
            await manager.remove_replicas([first.replica_id], drain_timeout_s=1.0)
        assert err.value.field == "replica_ids" and "colocated learner" in str(err.value)
        assert await manager.remove_replicas([second.replica_id], drain_timeout_s=1.0) == [second.replica_id]
        assert await asyncio.wait_for(learner[0].where.remote(), 10) == (node, gpus)  # alive
    finally:
        await manager.shutdown()


async def test_separate_learner_gets_devices_no_replica_has(cluster):
    manager = await LLMServerManager.create(sim_config(2))
    try:
        taken = {(r.node_id, d) for r in await manager.get_replicas() for d in r.devices}
        node, gpus = await learner_probe(manager)
        assert len(gpus) == 1 and (node, gpus[0]) not in taken
    finally:
        await manager.shutdown()


async def test_more_devices_than_the_cluster_has_fail_fast_naming_the_field(cluster):
    started = time.monotonic()
    with pytest.raises(InsufficientResources) as err:
        await LLMServerManager.create(sim_config(9))  # 18 GPUs asked, 12 exist
    assert time.monotonic() - started < 30
    assert err.value.field == "rollout.num_replicas"
    assert "9 replicas x 2 GPU" in str(err.value) and "12 GPU" in str(err.value)
    import ray

    assert ray.available_resources().get("GPU") == 3 * GPUS_PER_NODE  # nothing left reserved


async def test_a_separate_learner_stays_in_the_fleets_node_pool(cluster):
    """A fleet confined to nodes labelled ``pool: learn`` reserves its learner's device there too:
    it used to take one on any node, outside the pool its owner gave it."""
    node_args = dict(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE, node_ip_address="127.0.0.1")
    pool = cluster.add_node(labels={"pool": "learn"}, **node_args)
    cluster.wait_for_nodes()
    try:
        manager = await LLMServerManager.create(sim_config(1, node_labels={"pool": "learn"}))
        try:
            (replica,) = await manager.get_replicas()
            node, gpus = await learner_probe(manager)
            assert replica.node_id == pool.node_id
            assert node == pool.node_id and len(gpus) == 1 and gpus[0] not in replica.devices
        finally:
            await manager.shutdown()
    finally:
        await asyncio.to_thread(cluster.remove_node, pool)


async def test_a_dead_nodes_replicas_resume_elsewhere_without_losing_a_trajectory(cluster):
    """Two fresh nodes labelled 'elastic' host the fleet; one dies mid-rollout, then the other."""
    import ray

    node_args = dict(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE, node_ip_address="127.0.0.1")
    a = cluster.add_node(labels={"pool": "elastic"}, **node_args)
    b = cluster.add_node(labels={"pool": "elastic"}, **node_args)
    cluster.wait_for_nodes()
    config = sim_config(2, time_scale=0.3, strategy="SPREAD", node_labels={"pool": "elastic"})
    manager = await LLMServerManager.create(config)
    added = None
    try:
        before = {r.replica_id: r.node_id for r in await manager.get_replicas()}
        assert set(before.values()) == {a.node_id, b.node_id}
        client = manager.get_client(FullyAsyncLLMServerClient)
        tasks = [
            asyncio.ensure_future(
                client.generate(f"t{i}", prompt_ids=[1 + i % 400, 2, 3], sampling_params={"max_tokens": 64})
            )
            for i in range(500)
        ]
        rollout = asyncio.gather(*tasks)
        doomed = next(rid for rid, node in before.items() if node == a.node_id)

        def served_by_doomed() -> bool:
            return any(t.done() and t.result().extra_fields["replica_id"] == doomed for t in tasks)

        # kill the node once its replica has both answered some requests and has others in flight
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:
            busy = await manager.status()
            if served_by_doomed() and (busy.replicas[doomed].inflight or 0) > 0:
                break
            assert loop.time() < deadline, "the doomed replica never served and held requests at once"
            await asyncio.sleep(0.02)
        assert not rollout.done()
        await asyncio.to_thread(cluster.remove_node, a)  # a real node death, requests in flight on it
        assert busy.replicas[doomed].inflight > 0
        outs = await asyncio.wait_for(rollout, 120)
        assert len(outs) == 500
        assert all(o.stop_reason in ("stop", "length") and len(o.token_ids) >= 1 for o in outs)
        assert not any(o.extra_fields.get("resume_exhausted") for o in outs)
        moved = [rid for rid, node in before.items() if node == a.node_id]
        assert moved and {o.extra_fields["replica_id"] for o in outs} == set(before)  # both served
        # The dead node's replica restarts on the remaining capacity (node b has room for one more).
        await wait_for(
            lambda s: all(s.replicas[rid].state == "healthy" and s.replicas[rid].node_id == b.node_id for rid in moved),
            manager,
        )
        # Node b dies too: no node with the label has room now, so both wait, visibly.
        await asyncio.to_thread(cluster.remove_node, b)
        status = await wait_for(lambda s: all(r.state == "pending" for r in s.replicas.values()), manager)
        assert "waiting for devices" in next(iter(status.replicas.values())).detail
        # A node that joins is used: the pending replicas start there and serve again.
        added = cluster.add_node(labels={"pool": "elastic"}, **node_args)
        await wait_for(
            lambda s: all(r.state == "healthy" and r.node_id == added.node_id for r in s.replicas.values()), manager
        )
        out = await client.generate("after", prompt_ids=[5, 6, 7], sampling_params={"max_tokens": 8})
        assert out.stop_reason in ("stop", "length")
    finally:
        await manager.shutdown()
        if added is not None:
            cluster.remove_node(added)
    assert all(n["Alive"] is False for n in ray.nodes() if n["Labels"].get("pool") == "elastic")


async def wait_for(predicate, manager, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        status = await manager.status()
        if predicate(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s: {status['replicas']}")
        await asyncio.sleep(0.2)


async def test_joining_a_cluster_ships_this_package_to_its_nodes(cluster):
    """``ray.address`` set: the job's runtime_env carries rollfleet, so a worker node has the shipped
    copy on its path (here every node also sees the editable install, which Python's import
    system prefers; on a real worker node without an install the shipped copy is the one found)
    and a fleet comes up with no other change."""
    import ray

    from rollfleet.config import RayConfig
    from rollfleet.manager.ray_runtime import ensure_ray

    ray.shutdown()
    assert ensure_ray(RayConfig(address=cluster.address, namespace="rollfleet-join-test")) is True

    @ray.remote(num_cpus=0)
    def shipped_copy() -> tuple[list, list]:
        import os
        import sys

        uris = ray.get_runtime_context().runtime_env.get("py_modules", [])
        copies = [
            p
            for p in sys.path
            if "runtime_resources" in p and os.path.isfile(os.path.join(p, "rollfleet", "manager", "placement.py"))
        ]
        return uris, copies

    uris, copies = await shipped_copy.remote()
    assert any(u.startswith("gcs://") for u in uris) and copies, (uris, copies)
    manager = await LLMServerManager.create(sim_config(2))
    try:
        assert all(r.state == "healthy" for r in await manager.get_replicas())
    finally:
        await manager.shutdown()
