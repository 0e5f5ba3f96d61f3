"""Placement of replicas (and of the learner) on a Ray cluster.

A replica is one placement group: one bundle per device of its tensor-parallel group, strategy
``STRICT_PACK``, so the group shares a node (NVLink, one engine process group). Ray places each
group on its own and has no strategy *across* groups, so the node of each replica is chosen here
(``PACK``, ``SPREAD``, ``STRICT_SPREAD`` over the nodes' free resources and the label selector)
and the group is pinned there with a label selector on Ray's ``ray.io/node-id`` label. Ray still
makes the reservation, so nothing is double-booked with other jobs on the cluster; a group that
Ray cannot place within ``timeout_s`` is removed again and reported, never left pending forever.

Devices: Ray assigns accelerator ids per bundle and tells only the actor in a bundle which ones
it got. The replica actor sits in bundle 0; every further bundle is held by a small
:class:`DeviceHolder` actor that reports its ids, so the engine process can be started with
exactly the replica's devices (``CUDA_VISIBLE_DEVICES``) and the reservation shows in Ray's
accounting for as long as the replica lives.

A node that dies takes its groups with it: Ray would try to reschedule a group pinned to a dead
node forever, so the controller releases it and asks for a new one on a live node (or waits,
``pending``, until one has room).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from rollfleet.config import PlacementConfig
from rollfleet.config.rollout import tensor_parallel_field
from rollfleet.errors import InsufficientResources
from rollfleet.manager.cluster_view import (
    DEVICE_RESOURCE,
    NodeInfo,
    choose_node,
    describe_cluster,
    device_bundle,
    label_matches,
    one_replica_short,
    replicas_that_fit,
)

logger = logging.getLogger(__name__)

#: Ray's built-in label holding a node's id (every node has it).
NODE_ID_LABEL = "ray.io/node-id"


def list_nodes(with_free: bool = True) -> list[NodeInfo]:
    """The cluster's nodes with their total and free resources (GCS calls: run off the loop)."""
    import ray

    free_by_node: dict[str, dict[str, float]] = {}
    try:  # free resources per node; without them the totals stand in and Ray's own wait decides
        from ray._private import state

        if with_free:
            free_by_node = state.available_resources_per_node()
    except Exception:  # pragma: no cover - private API moved
        logger.debug("per-node free resources unavailable", exc_info=True)
    nodes = []
    for n in ray.nodes():
        total = {k: float(v) for k, v in (n.get("Resources") or {}).items()}
        free = {k: float(v) for k, v in free_by_node.get(n["NodeID"], total).items()}
        nodes.append(
            NodeInfo(n["NodeID"], n["NodeManagerAddress"], bool(n["Alive"]), total, free, n.get("Labels") or {})
        )
    return nodes


@dataclass
class WorkerPlacement:
    """A share of one bundle, for one actor: a replica rank or a learner worker."""

    pg: Any
    bundle_index: int
    device: str  # "gpu" | "cpu"
    bundle: Mapping[str, float]
    fraction: float
    node_id: str = ""
    node_ip: str = ""

    def actor_options(self) -> dict[str, Any]:
        """``Actor.options(**this)``: scheduled in the bundle with this share of its resources."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        share = {k: v * self.fraction for k, v in self.bundle.items()}
        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=self.bundle_index
            ),
            "num_cpus": share.pop("CPU", 0.0),
            "num_gpus": share.pop("GPU", 0.0),
            "resources": share,
        }


@dataclass
class ReplicaPlacement:
    """The placement group of one replica and where it landed."""

    pg: Any
    node_id: str
    node_ip: str
    device: str
    bundle: Mapping[str, float]
    num_bundles: int
    #: Share of each bundle the replica takes (the rest belongs to a colocated learner).
    fraction: float = 1.0
    holders: list[Any] = field(default_factory=list, repr=False)

    def rank(self, index: int, fraction: Optional[float] = None) -> WorkerPlacement:
        return WorkerPlacement(
            self.pg,
            index,
            self.device,
            self.bundle,
            self.fraction if fraction is None else fraction,
            self.node_id,
            self.node_ip,
        )


class Placer:
    """Reserves, tracks and releases the placement groups of one fleet (used by its controller).

    Reservations are serialised: each node choice must see the resources the previous one took.
    """

    def __init__(self, config: PlacementConfig, devices_per_replica: int, engine: str) -> None:
        self.config = config
        self.devices_per_replica = devices_per_replica
        self.engine = engine
        self.placements: dict[str, ReplicaPlacement] = {}
        self._device: Optional[str] = None
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ cluster view
    async def nodes(self, with_free: bool = True) -> list[NodeInfo]:
        return await asyncio.to_thread(list_nodes, with_free)

    async def device(self) -> str:
        """``gpu`` | ``cpu`` | ``none``, resolving ``auto`` against the cluster once."""
        if self._device is None:
            want = self.config.device
            if want == "auto":
                has_gpu = any(n.alive and n.total.get("GPU", 0) > 0 for n in await self.nodes())
                want = "gpu" if has_gpu else ("none" if self.engine == "sim" else "cpu")
            self._device = want
        return self._device

    async def dead_nodes(self) -> set[str]:
        """Ids of the nodes this fleet has replicas on that Ray reports dead."""
        if not self.placements:
            return set()
        alive = {n.node_id for n in await self.nodes(with_free=False) if n.alive}
        return {p.node_id for p in self.placements.values() if p.node_id not in alive}

    async def check_capacity(self, total_replicas: int, field_name: str) -> None:
        """Fail at once when the cluster could never hold ``total_replicas`` replicas."""
        device = await self.device()
        if device == "none":
            return
        nodes = await self.nodes()
        bundle = device_bundle(device, self.config)
        selector = self.config.node_labels
        per_node = [
            replicas_that_fit(n, bundle, self.devices_per_replica, free=False)
            for n in nodes
            if n.alive and label_matches(n.labels, selector)
        ]
        if self.config.strategy == "STRICT_SPREAD":
            per_node = [min(1, c) for c in per_node]
        if total_replicas <= sum(per_node):
            return
        tp = self.devices_per_replica
        res = DEVICE_RESOURCE[device]
        cluster = describe_cluster(nodes, selector, list(bundle))
        short = one_replica_short(nodes, bundle, tp, selector)
        if short is not None:  # no node holds even one replica: the replica's size is the limit
            name, need, most = short
            raise InsufficientResources(
                self._field_of(name, device),
                f"{need:g} {name} on one node for one replica ({tp} x {bundle[name]:g} {name}: a replica's "
                f"devices share a node)",
                cluster,
                f"at most {most:g} {name} on one live node",
            )
        raise InsufficientResources(
            field_name,
            f"{total_replicas} replicas x {tp} {res} (tensor_parallel_size={tp}, "
            f"{self.config.cpus_per_device:g} CPU per device, strategy {self.config.strategy})",
            cluster,
            f"room for {sum(per_node)} such replicas",
        )

    def _field_of(self, resource: str, device: str) -> str:
        """The setting that sizes ``resource`` in one replica (on CPU devices the CPUs per device,
        unless the replica spans several devices)."""
        tp_field = tensor_parallel_field(self.engine)
        if resource == "CPU":
            return tp_field if device == "cpu" and self.devices_per_replica > 1 else "rollout.placement.cpus_per_device"
        if resource == DEVICE_RESOURCE[device]:
            return tp_field
        return f"rollout.placement.resources.{resource}"

    # ------------------------------------------------------------------ reserve / release
    async def reserve(self, rid: str, fraction: float = 1.0) -> Optional[ReplicaPlacement]:
        """Reserve devices for replica ``rid`` now; None when this fleet places nothing.

        Raises :class:`InsufficientResources` when no live node has room or Ray cannot place the
        group within ``timeout_s``.
        """
        device = await self.device()
        if device == "none":
            return None
        async with self._lock:
            bundle = device_bundle(device, self.config)
            tp = self.devices_per_replica
            nodes = await self.nodes()
            hosted: dict[str, int] = {}
            for p in self.placements.values():
                hosted[p.node_id] = hosted.get(p.node_id, 0) + 1
            node = choose_node(nodes, bundle, tp, self.config.strategy, self.config.node_labels, hosted)
            if node is None:
                raise InsufficientResources(
                    f"replica {rid}",
                    f"{tp} free {DEVICE_RESOURCE[device]} on one node (strategy {self.config.strategy})",
                    describe_cluster(nodes, self.config.node_labels, list(bundle)),
                    "no live node has room now",
                )
            selector = {**self.config.node_labels, NODE_ID_LABEL: node.node_id}
            pg = await self._create_group([dict(bundle)] * tp, "STRICT_PACK", [selector] * tp, rid, nodes)
            placement = ReplicaPlacement(pg, node.node_id, node.ip, device, bundle, tp, fraction)
            self.placements[rid] = placement
        placement.holders = [
            DeviceHolder.options(**placement.rank(i).actor_options()).remote()  # type: ignore[attr-defined]  # a Ray actor class
            for i in range(1, tp)
        ]
        return placement

    async def reserve_worker(self, name: str) -> Optional[WorkerPlacement]:
        """One device of the fleet's kind for a worker of its own (the learner in separate mode),
        on a node of the fleet's pool (``node_labels``) as its replicas are."""
        device = await self.device()
        if device == "none":
            return None
        bundle = device_bundle(device, self.config)
        nodes = await self.nodes()
        selector = [dict(self.config.node_labels)] if self.config.node_labels else None
        pg = await self._create_group([dict(bundle)], "STRICT_PACK", selector, name, nodes)
        return WorkerPlacement(pg, 0, device, bundle, 1.0)

    async def _create_group(
        self, bundles: list[dict[str, float]], strategy: str, selector: Any, owner: str, nodes: Sequence[NodeInfo]
    ) -> Any:
        from ray.util.placement_group import placement_group, remove_placement_group

        pg = placement_group(
            bundles, strategy=strategy, name=f"rollfleet-{owner}-{uuid.uuid4().hex[:6]}", bundle_label_selector=selector
        )
        try:
            await asyncio.wait_for(pg.ready(), self.config.timeout_s)
        except asyncio.TimeoutError:
            remove_placement_group(pg)
            raise InsufficientResources(
                "rollout.placement.timeout_s",
                f"{len(bundles)} x {bundles[0]} for {owner}",
                describe_cluster(nodes, self.config.node_labels, list(bundles[0])),
                f"Ray could not place it within {self.config.timeout_s:g} s (other jobs may hold the devices)",
            ) from None
        except BaseException:  # cancelled (a removal, a shutdown): nobody else knows of this group yet
            remove_placement_group(pg)
            raise
        return pg

    async def devices_of(self, placement: ReplicaPlacement) -> list[str]:
        """Accelerator ids of ranks 1.. (rank 0's are the replica actor's own)."""
        ids = await asyncio.gather(*(h.accelerator_ids.remote() for h in placement.holders))
        return [i for rank in ids for i in rank]

    def release(self, rid: str) -> None:
        placement = self.placements.pop(rid, None)
        if placement is not None:
            release_group(placement)

    def release_all(self) -> None:
        for rid in list(self.placements):
            self.release(rid)


def release_group(placement: ReplicaPlacement | WorkerPlacement) -> None:
    """Kill the group's holders and give its resources back (a dead node's group included)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for holder in getattr(placement, "holders", ()):
        try:
            ray.kill(holder, no_restart=True)
        except Exception:
            pass
    try:
        remove_placement_group(placement.pg)
    except Exception:  # already gone with its creator
        logger.debug("placement group already removed", exc_info=True)


try:
    import ray

    @ray.remote(num_cpus=0)
    class DeviceHolder:
        """Holds one bundle of a replica's group and reports the devices Ray assigned to it."""

        def accelerator_ids(self) -> list[str]:
            return list(ray.get_runtime_context().get_accelerator_ids().get("GPU", []))

except ImportError:  # pragma: no cover
    DeviceHolder = None  # type: ignore[assignment,misc]


__all__ = [
    "NodeInfo",
    "WorkerPlacement",
    "ReplicaPlacement",
    "Placer",
    "DeviceHolder",
    "list_nodes",
    "label_matches",
    "choose_node",
    "device_bundle",
    "replicas_that_fit",
    "describe_cluster",
    "release_group",
]
