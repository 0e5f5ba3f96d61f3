"""The cluster as placement sees it: nodes, what one replica needs, where it fits, and how to say
so when it does not (pure functions over a snapshot of Ray's node table: no Ray calls here).

An error about room names what limits it: a replica's devices share one node, so a cluster with
enough devices in all may still have no node that holds one replica; the setting to change is
then the replica's (its tensor parallelism, its CPUs per device, a custom resource), not the
number of replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

from rollfleet.config import PlacementConfig

#: The Ray resource one device of each kind reserves.
DEVICE_RESOURCE = {"gpu": "GPU", "cpu": "CPU"}


@dataclass(frozen=True)
class NodeInfo:
    """One Ray node as placement sees it."""

    node_id: str
    ip: str
    alive: bool
    total: Mapping[str, float]
    free: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)


def label_matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """Ray's label-selector rules: ``x``, ``!x``, ``in(x,y)``, ``!in(x,y)``."""
    for key, want in selector.items():
        have = labels.get(key)
        negate = want.startswith("!")
        want = want[1:] if negate else want
        if want.startswith("in(") and want.endswith(")"):
            ok = have in {v.strip() for v in want[3:-1].split(",")}
        else:
            ok = have == want
        if ok == negate:
            return False
    return True


def device_bundle(device: str, config: PlacementConfig) -> dict[str, float]:
    """The bundle of one device: the device, the CPUs that go with it, custom resources."""
    bundle = {"CPU": float(config.cpus_per_device)}
    if device == "gpu":
        bundle["GPU"] = 1.0
    bundle.update(config.resources)
    return bundle


def replicas_that_fit(node: NodeInfo, bundle: Mapping[str, float], devices: int, *, free: bool) -> int:
    """How many replicas of ``devices`` bundles fit on ``node`` (in its free or total resources)."""
    have = node.free if free else node.total
    counts = [
        math.floor(have.get(res, 0.0) / (amount * devices) + 1e-9) for res, amount in bundle.items() if amount > 0
    ]
    return max(0, min(counts)) if counts else 0


def choose_node(
    nodes: Sequence[NodeInfo],
    bundle: Mapping[str, float],
    devices: int,
    strategy: str,
    selector: Mapping[str, str],
    hosted: Mapping[str, int],
) -> Optional[NodeInfo]:
    """The node for the next replica, or None when no live node has room.

    ``hosted`` counts this fleet's replicas per node. PACK: the node already hosting most of them,
    then the tightest fit (a node is filled before the next is opened); SPREAD: the node hosting
    fewest, then the most room; STRICT_SPREAD: only nodes hosting none. Ties keep Ray's node order.
    """
    # (Ray's order, node, replicas that fit in its free resources): room is computed once a node.
    candidates = [
        (i, n, room)
        for i, n in enumerate(nodes)
        if n.alive
        and label_matches(n.labels, selector)
        and (room := replicas_that_fit(n, bundle, devices, free=True)) > 0
    ]
    if strategy == "STRICT_SPREAD":
        candidates = [c for c in candidates if hosted.get(c[1].node_id, 0) == 0]
    if not candidates:
        return None
    if strategy == "PACK":
        key = lambda c: (-hosted.get(c[1].node_id, 0), c[2], c[0])  # noqa: E731
    else:
        key = lambda c: (hosted.get(c[1].node_id, 0), -c[2], c[0])  # noqa: E731
    return min(candidates, key=key)[1]


def describe_cluster(nodes: Sequence[NodeInfo], selector: Mapping[str, str], resources: Sequence[str] = ()) -> str:
    """'3 live nodes with 12 GPU, 6 CPU (at most 4 GPU on one node)' for error messages; with
    ``resources`` (a replica's custom ones), their totals too, none left out for being 0."""
    live = [n for n in nodes if n.alive and label_matches(n.labels, selector)]
    where = f" matching {dict(selector)}" if selector else ""
    if not live:
        return f"no live node{where}"
    totals: dict[str, float] = {}
    custom = [r for r in resources if r not in ("GPU", "CPU")]
    for n in live:
        for res in ("GPU", "CPU", *custom):
            totals[res] = totals.get(res, 0.0) + n.total.get(res, 0.0)
    most_gpu = max(n.total.get("GPU", 0.0) for n in live)
    parts = ", ".join(f"{v:g} {k}" for k, v in totals.items() if v or k in custom)
    return f"{len(live)} live node{'s' if len(live) != 1 else ''}{where} with {parts} (at most {most_gpu:g} GPU on one node)"


def resource_order(bundle: Mapping[str, float]) -> list[str]:
    """The resources of ``bundle`` a replica needs, in the order a shortage is blamed on them: the
    devices and custom resources before CPUs (short of both, the replica's size is the fix)."""
    return [res for res, amount in sorted(bundle.items(), key=lambda kv: kv[0] == "CPU") if amount > 0]


def one_replica_short(
    nodes: Sequence[NodeInfo], bundle: Mapping[str, float], devices: int, selector: Mapping[str, str]
) -> Optional[tuple[str, float, float]]:
    """``(resource, needed on one node, most any candidate node has)`` for the resource that keeps
    every live node matching ``selector`` from holding one replica of ``devices`` bundles, or None.

    A replica needs all its resources on one node, so the resources are taken in
    :func:`resource_order` and the candidates narrowed at each step to the nodes with enough of
    those checked so far: taken one by one over all nodes, a CPU-only head with many CPUs and a
    GPU node with few each hid the other's shortage, and the count of replicas was blamed. The
    ``most`` reported is thus among nodes that have enough of the resources before it."""
    candidates = [n for n in nodes if n.alive and label_matches(n.labels, selector)]
    if not candidates:
        return None  # no node at all: not a question of the replica's size
    for res in resource_order(bundle):
        need = bundle[res] * devices
        most = max(n.total.get(res, 0.0) for n in candidates)
        if most + 1e-9 < need:
            return res, need, most
        candidates = [n for n in candidates if n.total.get(res, 0.0) + 1e-9 >= need]
    return None


def without_held(nodes: Sequence[NodeInfo], held: Mapping[str, Sequence[Mapping[str, float]]]) -> list[NodeInfo]:
    """``nodes`` as they would be with only the bundles in ``held`` (per node id) taken: their
    totals less those, free and total alike (whatever other jobs hold now, given back)."""
    out = []
    for n in nodes:
        total = dict(n.total)
        for bundle in held.get(n.node_id, ()):
            for res, amount in bundle.items():
                total[res] = max(0.0, total.get(res, 0.0) - amount)
        out.append(replace(n, total=total, free=total))
    return out


__all__ = [
    "DEVICE_RESOURCE",
    "NodeInfo",
    "choose_node",
    "describe_cluster",
    "device_bundle",
    "label_matches",
    "one_replica_short",
    "replicas_that_fit",
    "resource_order",
    "without_held",
]
