"""What a fleet holds on a Ray cluster: the node table as placement reads it, the placement groups
reserved for a replica or a worker (and the share of a bundle each actor takes), and how they are
given back. The choices of where they go are :mod:`rollfleet.manager.placement`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from rollfleet.manager.cluster_view import NodeInfo

logger = logging.getLogger(__name__)


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


__all__ = ["DeviceHolder", "ReplicaPlacement", "WorkerPlacement", "list_nodes", "release_group"]
