"""Typed records of the control plane: what ``get_replicas()``, ``add_replicas()`` and
``status()`` return, from the controller actor through the manager to the gateway's admin routes.

Typed rather than dicts so that a caller's typo is an ``AttributeError`` at the line that made it
(not a ``None`` from ``.get`` three layers later), states are :class:`HealthState` members rather
than strings, and the one field that must never leave the cluster (a replica's Ray handle) is
excluded from every serialisation instead of being stripped by hand wherever JSON is written.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from rollfleet.health import HealthState


class _Record(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, populate_by_name=True)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (states as strings, no handles)."""
        return self.model_dump(mode="json", by_alias=True)


class ReplicaInfo(_Record):
    """One replica: where it runs, what it serves, how to reach it."""

    replica_id: str
    state: HealthState
    address: str = Field(
        "",
        description="The engine's URL (http://node-ip:port: its server, or the exporter of its /metrics), "
        "or a pseudo-address (sim://).",
    )
    server_socket: str = Field(
        "", description="The engine server's private Unix socket on its node (vLLM's default); empty: none."
    )
    weight_version: Optional[int] = None
    restarts: int = 0
    node_id: str = Field("", description="Ray node id; empty when the replica reserves nothing.")
    node_ip: str = ""
    devices: Optional[list[str]] = Field(None, description="Accelerator ids Ray assigned (None: none reserved).")
    #: The replica's Ray actor handle, for code inside the cluster; never serialised.
    handle: Any = Field(None, exclude=True, repr=False)


class ReplicaStatus(ReplicaInfo):
    """A replica as ``status()`` shows it: :class:`ReplicaInfo` plus health and load."""

    consecutive_failures: int = 0
    inflight: Optional[int] = None
    kv_usage: Optional[float] = None
    detail: str = Field("", description="Why it is in its state (the last transition's reason).")


class FleetEvent(_Record):
    """One health transition of one replica."""

    t: float
    replica_id: str
    from_state: HealthState = Field(alias="from")
    to: HealthState
    detail: str = ""


class FleetStatus(_Record):
    """The whole fleet: versions, membership, each replica, recent transitions, the manager's clients."""

    current_version: Optional[int]
    membership_epoch: int
    replicas: dict[str, ReplicaStatus]
    events: list[FleetEvent] = Field(default_factory=list)
    clients: list[dict[str, Any]] = Field(default_factory=list)


__all__ = ["ReplicaInfo", "ReplicaStatus", "FleetEvent", "FleetStatus"]
