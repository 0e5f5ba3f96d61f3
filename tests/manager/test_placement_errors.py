"""Placement errors that must name the setting to change, without Ray: the separate learner's
device in the capacity checks, a shortage on one node that has the other resources, and
``device: auto`` resolved within the fleet's node pool."""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

import pytest

from rollfleet.config import PlacementConfig
from rollfleet.errors import InsufficientResources
from rollfleet.manager.cluster_view import NodeInfo, one_replica_short
from rollfleet.manager.placement import NODE_ID_LABEL, Placer, ReplicaPlacement

pytestmark = pytest.mark.unit

GPU_BUNDLE = {"CPU": 1.0, "GPU": 1.0}


def node(name: str, gpus: float = 2, cpus: float = 2, free_gpus: float | None = None, labels=None) -> NodeInfo:
    free = gpus if free_gpus is None else free_gpus
    return NodeInfo(
        name, f"10.0.0.{name[-1]}", True, {"GPU": gpus, "CPU": cpus}, {"GPU": free, "CPU": cpus}, labels or {}
    )


def placer_over(nodes: list[NodeInfo], tp: int, **placement: Any) -> Placer:
    """A placer that sees ``nodes`` as Ray's node table (no Ray)."""
    placer = Placer(PlacementConfig(**{"device": "gpu", **placement}), tp, "vllm")

    async def listed(with_free: bool = True) -> list[NodeInfo]:
        return nodes

    placer.nodes = listed  # type: ignore[method-assign]
    return placer


class Groups:
    """Ray's placement groups, faked: each is ready at once (or never), and each call is kept."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, ready: bool = True) -> None:
        self.created: list[dict[str, Any]] = []
        self.removed: list[object] = []
        self.ready = ready
        ray_pg = importlib.import_module("ray.util.placement_group")  # the module, not ray.util's function
        monkeypatch.setattr(ray_pg, "placement_group", self.placement_group)
        monkeypatch.setattr(ray_pg, "remove_placement_group", self.removed.append)

    def placement_group(self, bundles: list[dict[str, float]], **kwargs: Any) -> Any:
        self.created.append({"bundles": bundles, **kwargs})
        ready = self.ready

        class Group:
            def ready(self) -> "asyncio.Future[None]":
                future = asyncio.get_running_loop().create_future()
                if ready:
                    future.set_result(None)
                return future  # never done when Ray cannot place it

        return Group()


def hold(placer: Placer, rid: str, node_id: str) -> None:
    """Record replica ``rid`` as placed on ``node_id`` (its group held there)."""
    tp = placer.devices_per_replica
    placer.placements[rid] = ReplicaPlacement(object(), node_id, "10.0.0.9", "gpu", GPU_BUNDLE, tp)


async def test_a_separate_learner_on_a_cluster_the_fleet_fills_fails_at_once_naming_the_replica_count(monkeypatch):
    """It used to wait out ``timeout_s`` for Ray and then blame the timeout and other jobs."""
    groups = Groups(monkeypatch, ready=False)
    nodes = [node(f"n{i}", free_gpus=0) for i in (1, 2, 3)]
    placer = placer_over(nodes, 2, timeout_s=2.0)
    for i in (1, 2, 3):
        hold(placer, f"replica-{i - 1}", f"n{i}")
    with pytest.raises(InsufficientResources) as err:
        await asyncio.wait_for(placer.reserve_worker("learner"), 1.0)
    message = str(err.value)
    assert err.value.field == "rollout.num_replicas"
    assert "one device bundle beyond the fleet's 3 replicas" in message and "replicas hold the devices" in message
    assert "rollout.placement.colocate" in message
    assert groups.created == [] and placer.workers == {}


async def test_the_learner_is_pinned_to_a_node_it_chose_and_made_again_gets_the_same_reservation(monkeypatch):
    groups = Groups(monkeypatch)
    nodes = [node("n1", free_gpus=0), node("n2", free_gpus=2), node("n3", free_gpus=1)]
    placer = placer_over(nodes, 2, node_labels={})
    hold(placer, "replica-0", "n1")
    first = await placer.reserve_worker("learner")
    assert first is not None and (first.node_id, first.node_ip) == ("n3", "10.0.0.3")  # the tightest fit
    assert groups.created[0]["bundle_label_selector"] == [{NODE_ID_LABEL: "n3"}]
    assert await placer.reserve_worker("learner") is first and len(groups.created) == 1


async def test_the_learner_waits_on_a_node_other_jobs_hold_when_the_fleet_leaves_room_there(monkeypatch):
    """Nothing free now, but the fleet's own replicas are not what holds it: Ray waits as before."""
    groups = Groups(monkeypatch)
    nodes = [node("n1", free_gpus=0), node("n2", free_gpus=0)]
    placer = placer_over(nodes, 2)
    hold(placer, "replica-0", "n1")
    worker = await placer.reserve_worker("learner")
    assert worker is not None and worker.node_id == "n2"
    assert groups.created[0]["bundle_label_selector"] == [{NODE_ID_LABEL: "n2"}]


async def test_capacity_checks_take_the_learners_bundle_off_its_node(monkeypatch):
    """Two tp=2 replicas and a learner on three 2-GPU nodes leave no room for a third replica: the
    check counted the learner's node as room and passed, and the reservation then failed naming a
    replica id instead of the setting."""
    Groups(monkeypatch)
    nodes = [node("n1", free_gpus=0), node("n2", free_gpus=0), node("n3")]
    placer = placer_over(nodes, 2, strategy="PACK")
    hold(placer, "replica-0", "n1")
    hold(placer, "replica-1", "n2")
    learner = await placer.reserve_worker("learner")
    assert learner is not None and learner.node_id == "n3"
    await placer.check_capacity(2, "add_replicas(n)")
    with pytest.raises(InsufficientResources) as err:
        await placer.check_capacity(3, "add_replicas(n)")
    assert err.value.field == "add_replicas(n)"
    assert "room for 2 such replicas beside the device bundle held for learner" in str(err.value)


async def test_a_learner_and_a_replica_reserved_at_once_see_each_other(monkeypatch):
    """The learner's reservation took no lock: a replica chosen at the same moment saw the same
    free device. Serialised, the second one's node query comes after the first one's group."""
    Groups(monkeypatch)
    placer = placer_over([node("n1")], 1)
    order: list[str] = []
    listed = placer.nodes

    async def nodes(with_free: bool = True) -> list[NodeInfo]:
        order.append("nodes")
        await asyncio.sleep(0.01)
        return await listed(with_free)

    placer.nodes = nodes  # type: ignore[method-assign]
    await placer.device()
    order.clear()
    original_create = placer._create_group

    async def create(*args: Any) -> Any:
        order.append("group")
        return await original_create(*args)

    placer._create_group = create  # type: ignore[method-assign]
    await asyncio.gather(placer.reserve_worker("learner"), placer.reserve("replica-0"))
    assert order == ["nodes", "group", "nodes", "group"]


def test_the_resource_no_node_with_the_others_has_enough_of_is_the_one_reported():
    """A CPU-only head with 16 CPUs and a GPU node with 8 GPUs but 4 CPUs: taken one by one over
    all nodes, neither looked short."""
    nodes = [node("n0", gpus=0, cpus=16), node("n1", gpus=8, cpus=4)]
    assert one_replica_short(nodes, GPU_BUNDLE, 8, {}) == ("CPU", 8.0, 4.0)
    assert one_replica_short(nodes, GPU_BUNDLE, 4, {}) is None
    assert one_replica_short(nodes, GPU_BUNDLE, 16, {}) == ("GPU", 16.0, 8.0)


async def test_a_gpu_node_short_of_cpus_is_blamed_on_the_cpus_per_device_not_the_count():
    placer = placer_over([node("n0", gpus=0, cpus=16), node("n1", gpus=8, cpus=4)], 8, cpus_per_device=1)
    with pytest.raises(InsufficientResources) as err:
        await placer.check_capacity(1, "rollout.num_replicas")
    assert err.value.field == "rollout.placement.cpus_per_device"
    assert "at most 4 CPU on one live node that has the other resources (8 GPU)" in str(err.value)


async def test_device_auto_resolves_against_the_fleets_node_pool_only():
    """A GPU node outside the pool made the fleet ask for GPUs; its CPU nodes could never give them."""
    nodes = [
        NodeInfo("gpu", "10.0.0.1", True, {"CPU": 16, "GPU": 8}, {"CPU": 16, "GPU": 8}, {"pool": "train"}),
        NodeInfo("cpu", "10.0.0.2", True, {"CPU": 64}, {"CPU": 64}, {"pool": "rollout"}),
    ]
    placer = placer_over(nodes, 1, device="auto", node_labels={"pool": "rollout"})
    assert await placer.device() == "cpu"
    await placer.check_capacity(2, "rollout.num_replicas")
    assert await placer_over(nodes, 1, device="auto", node_labels={"pool": "train"}).device() == "gpu"
