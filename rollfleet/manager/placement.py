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
import time
import uuid
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
    resource_order,
    without_held,
)
from rollfleet.manager.placement_groups import (
    DeviceHolder,
    ReplicaPlacement,
    WorkerPlacement,
    list_nodes,
    release_group,
)

logger = logging.getLogger(__name__)

#: Ray's built-in label holding a node's id (every node has it).
NODE_ID_LABEL = "ray.io/node-id"
#: How long a reservation looks again for room Ray's view does not show yet (a release lags it).
FREE_VIEW_LAG_S = 2.0


class Placer:
    """Reserves, tracks and releases the placement groups of one fleet (used by its controller).

    Reservations are serialised: each node choice must see the resources the previous one took.
    """

    def __init__(self, config: PlacementConfig, devices_per_replica: int, engine: str) -> None:
        self.config = config
        self.devices_per_replica = devices_per_replica
        self.engine = engine
        self.placements: dict[str, ReplicaPlacement] = {}
        #: Bundles of the fleet's own workers (the learner in separate mode), by name.
        self.workers: dict[str, WorkerPlacement] = {}
        self._device: Optional[str] = None
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ cluster view
    async def nodes(self, with_free: bool = True) -> list[NodeInfo]:
        return await asyncio.to_thread(list_nodes, with_free)

    async def device(self) -> str:
        """``gpu`` | ``cpu`` | ``none``, resolving ``auto`` against the cluster once: against the
        live nodes of the fleet's pool (``node_labels``) only, where its replicas go (a GPU node
        outside the pool made a fleet confined to CPU nodes ask for GPUs it could never get)."""
        if self._device is None:
            want = self.config.device
            if want == "auto":
                selector = self.config.node_labels
                has_gpu = any(
                    n.alive and label_matches(n.labels, selector) and n.total.get("GPU", 0) > 0
                    for n in await self.nodes()
                )
                want = "gpu" if has_gpu else ("none" if self.engine == "sim" else "cpu")
            self._device = want
        return self._device

    async def dead_nodes(self) -> set[str]:
        """Ids of the nodes this fleet has replicas on that Ray reports dead."""
        if not self.placements:
            return set()
        alive = {n.node_id for n in await self.nodes(with_free=False) if n.alive}
        return {p.node_id for p in self.placements.values() if p.node_id not in alive}

    def _held(self, replicas: bool) -> dict[str, list[Mapping[str, float]]]:
        """The bundles this fleet holds, per node id: its workers' (the learner's), and with
        ``replicas`` its replicas' too (each group holds its full bundles, shared or not)."""
        held: dict[str, list[Mapping[str, float]]] = {}
        for worker in self.workers.values():
            held.setdefault(worker.node_id, []).append(worker.bundle)
        if replicas:
            for p in self.placements.values():
                held.setdefault(p.node_id, []).extend([p.bundle] * p.num_bundles)
        return held

    async def check_capacity(self, total_replicas: int, field_name: str, adding: Optional[int] = None) -> None:
        """Fail at once when the cluster could never hold ``total_replicas`` replicas (``adding``
        of them new ones, when the fleet grows: the error names what the caller asked for).

        The bundles of the fleet's own workers (a separate learner) are taken off their node's
        totals first: counted as room for replicas, they let a check pass that the reservation
        then failed, naming a replica instead of the setting."""
        device = await self.device()
        if device == "none":
            return
        nodes = await self.nodes()
        bundle = device_bundle(device, self.config)
        selector = self.config.node_labels
        per_node = [
            replicas_that_fit(n, bundle, self.devices_per_replica, free=False)
            for n in without_held(nodes, self._held(replicas=False))
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
            order = resource_order(bundle)
            # the resources checked before this one: ``most`` is among the nodes with enough of them
            before = ", ".join(f"{bundle[r] * tp:g} {r}" for r in order[: order.index(name)])
            raise InsufficientResources(
                self._field_of(name, device),
                f"{need:g} {name} on one node for one replica ({tp} x {bundle[name]:g} {name}: a replica's "
                f"devices share a node)",
                cluster,
                f"at most {most:g} {name} on one live node"
                + (f" that has the other resources ({before})" if before else ""),
            )
        beside = ""
        if self.workers:  # their bundles were taken off the room: say so, or the count looks wrong
            beside = f" beside the device bundle held for {', '.join(sorted(self.workers))}"
        asked = (
            f"{total_replicas} replicas"
            if adding is None
            else f"{adding} more replica{'s' * (adding != 1)} ({total_replicas} in all)"
        )
        raise InsufficientResources(
            field_name,
            f"{asked} x {tp} {res} (tensor_parallel_size={tp}, "
            f"{self.config.cpus_per_device:g} CPU per device, strategy {self.config.strategy})",
            cluster,
            f"room for {sum(per_node)} such replicas{beside}",
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
            hosted: dict[str, int] = {}
            for p in self.placements.values():
                hosted[p.node_id] = hosted.get(p.node_id, 0) + 1
            # Ray's view of free resources shows a removed group's devices 0.02-0.1 s after the
            # removal: a replica added right after another was removed (or a fleet launched right
            # after one shut down) saw no room. Look again for a moment before saying so.
            deadline = time.monotonic() + FREE_VIEW_LAG_S
            while True:
                nodes = await self.nodes()
                node = choose_node(nodes, bundle, tp, self.config.strategy, self.config.node_labels, hosted)
                if node is not None or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.1)
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
        on a node of the fleet's pool (``node_labels``) as its replicas are; the same one again
        for a name already reserved.

        The node is chosen here, as a replica's is, and recorded, so that :meth:`check_capacity`
        takes the bundle off that node (counted as room for replicas, it let more replicas pass
        the check than could be placed); and under the placer's lock, so that a replica reserved
        at the same moment sees what the worker took. Raises :class:`InsufficientResources` at
        once when the fleet's own replicas hold the devices the worker would need: Ray's wait
        could not end then.
        """
        device = await self.device()
        if device == "none":
            return None
        async with self._lock:
            if name in self.workers:
                return self.workers[name]
            bundle = device_bundle(device, self.config)
            nodes = await self.nodes()
            # PACK with no replicas counted: the tightest fit, so one device leaves whole nodes to replicas
            node = choose_node(nodes, bundle, 1, "PACK", self.config.node_labels, {})
            if node is None:
                node = self._worker_node_beside_fleet(name, nodes, bundle, device)
            selector = {**self.config.node_labels, NODE_ID_LABEL: node.node_id}
            pg = await self._create_group([dict(bundle)], "STRICT_PACK", [selector], name, nodes)
            worker = WorkerPlacement(pg, 0, device, bundle, 1.0, node.node_id, node.ip)
            self.workers[name] = worker
        return worker

    def _worker_node_beside_fleet(
        self, name: str, nodes: Sequence[NodeInfo], bundle: Mapping[str, float], device: str
    ) -> NodeInfo:
        """Where a worker waits when no node has its bundle free now: a node where only other jobs
        hold it (Ray waits ``timeout_s`` for them). Where the fleet's own groups hold it on every
        node, or no node could hold it at all, raises :class:`InsufficientResources` at once:
        waiting used to run out ``timeout_s`` and then blame other jobs."""
        labels = self.config.node_labels
        cluster = describe_cluster(nodes, labels, list(bundle))
        colocate = f"share a replica's device with rollout.placement.colocate (the {name} then needs none of its own)"
        if choose_node(without_held(nodes, {}), bundle, 1, "PACK", labels, {}) is None:  # even were all given back
            raise InsufficientResources(
                "rollout.placement.colocate",
                f"1 x {dict(bundle)} on one node for the {name}",
                cluster,
                f"no live node of the fleet's pool could hold it: {colocate}",
            )
        node = choose_node(without_held(nodes, self._held(replicas=True)), bundle, 1, "PACK", labels, {})
        if node is not None:
            return next(n for n in nodes if n.node_id == node.node_id)
        tp = self.devices_per_replica
        raise InsufficientResources(
            "rollout.num_replicas",
            f"1 x {dict(bundle)} for the {name}, one device bundle beyond the fleet's {len(self.placements)} "
            f"replicas x {tp} {DEVICE_RESOURCE[device]}",
            cluster,
            f"the fleet's replicas hold the devices on every live node that could take it: "
            f"fewer replicas, or {colocate}",
        )

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
        """Give back every replica's group and every worker's (the learner's) bundle."""
        for rid in list(self.placements):
            self.release(rid)
        for name in list(self.workers):
            release_group(self.workers.pop(name))


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
