"""The fleet's health view, shared by the manager (which writes it) and every client (which reads it).

Each replica moves through ``healthy -> suspect -> dead -> restarting -> syncing -> healthy``.
The controller (manager layer) probes replicas and drives the transitions; clients receive
:class:`FleetSnapshot` records and route only to replicas that are healthy *and* on the current
weight version (a restarted replica serves only after it has the current weights). A client that
sees a call fail quarantines the replica locally at once, without waiting for the next probe.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from rollfleet.types import LoadReport


class HealthState(str, enum.Enum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"  # a probe failed; still in the pool until failures reach the bound
    DEAD = "dead"
    RESTARTING = "restarting"
    SYNCING = "syncing"  # up, but waiting for the current weights
    PENDING = "pending"  # waiting for free devices (its node died and no other has room yet)
    DRAINING = "draining"  # being removed: finishes in-flight work, takes no new requests


class ReplicaState(str, enum.Enum):
    """A replica's own lifecycle, as the replica reports it (``LoadReport.state``, ``info()``);
    :class:`HealthState` is the controller's view of it."""

    STARTING = "starting"
    SYNCING = "syncing"  # started, waiting for the current weights before it serves
    SERVING = "serving"
    PAUSED = "paused"  # requests wait at its gate (weight update)
    SLEEPING = "sleeping"  # memory released; requests wait at its gate
    STOPPED = "stopped"


#: Transitions the controller may make; anything else is a bug.
ALLOWED_TRANSITIONS: dict[HealthState, frozenset[HealthState]] = {
    HealthState.HEALTHY: frozenset({HealthState.SUSPECT, HealthState.DEAD, HealthState.SYNCING, HealthState.DRAINING}),
    HealthState.SUSPECT: frozenset({HealthState.HEALTHY, HealthState.DEAD, HealthState.DRAINING}),
    HealthState.DEAD: frozenset({HealthState.RESTARTING, HealthState.DRAINING}),
    HealthState.RESTARTING: frozenset({HealthState.SYNCING, HealthState.DEAD, HealthState.PENDING}),
    HealthState.PENDING: frozenset({HealthState.SYNCING, HealthState.DEAD, HealthState.DRAINING}),
    HealthState.SYNCING: frozenset({HealthState.HEALTHY, HealthState.DEAD}),
    HealthState.DRAINING: frozenset(),
}


def can_transition(old: HealthState, new: HealthState) -> bool:
    return old == new or new in ALLOWED_TRANSITIONS[old]


@dataclass
class ReplicaRecord:
    """One replica as the fleet sees it."""

    replica_id: str
    handle: Any
    address: str = ""
    #: The engine server's private Unix socket on its node (empty: none), for operators and tests.
    server_socket: str = ""
    #: ``host:port`` of the replica's direct data plane; empty: requests go through Ray.
    data_plane: str = ""
    #: What a data-plane connection must present first (never shown outside the cluster).
    data_plane_token: str = field(default="", repr=False)
    state: HealthState = HealthState.SYNCING
    weight_version: Optional[int] = None
    consecutive_failures: int = 0
    #: When it last answered a probe (monotonic), and whether a probe is out now (one at a time).
    answered_at: float = field(default_factory=time.monotonic)
    probing: bool = False
    restarts: int = 0
    #: When its last restart brought it back (the loop's clock), and how many times in a row it
    #: died soon after one (within ``health.max_restart_backoff_s``): such restarts back off too.
    restarted_at: Optional[float] = None
    quick_deaths: int = 0
    load: Optional[LoadReport] = None
    detail: str = ""
    #: Where it runs: Ray node, that node's IP, accelerator ids (None: no devices reserved).
    node_id: str = ""
    node_ip: str = ""
    devices: Optional[list[str]] = None
    #: Its placement group (manager layer's ``ReplicaPlacement``); None when nothing is reserved.
    placement: Any = field(default=None, repr=False)
    #: Its restarts ran out (``health.max_restart_attempts``) and its devices went back to the
    #: cluster: nothing revisits it, and it counts against no capacity until it is removed.
    released: bool = False

    def routable(self, current_version: Optional[int]) -> bool:
        return self.state in (HealthState.HEALTHY, HealthState.SUSPECT) and self.weight_version == current_version


@dataclass
class FleetSnapshot:
    """What a client needs to route: membership (with handles when it changed), states, loads.

    ``membership_epoch`` changes whenever a replica is added, removed or restarted (new handle),
    so a client asks for handles only then.
    """

    membership_epoch: int
    current_version: Optional[int]
    states: dict[str, str]
    versions: dict[str, Optional[int]]
    loads: dict[str, LoadReport] = field(default_factory=dict)
    handles: Optional[dict[str, Any]] = None
    #: The version a rolling update is committing wave by wave (None otherwise): replicas already
    #: on it serve too, and new trajectories prefer them.
    rolling_version: Optional[int] = None
    #: Why each replica is in its state (the controller's last transition detail), so that a client
    #: that finds nothing routable can say why; not part of :meth:`signature`.
    details: dict[str, str] = field(default_factory=dict)
    #: (the controller's id, its changes so far): a client ignores a snapshot older than the one it
    #: applied (a slow refresh answered after a newer watch would undo it); not in :meth:`signature`.
    seq: tuple[str, int] = ("", 0)

    def signature(self) -> tuple:
        """What routing depends on, comparable across processes (no salted hashes)."""
        return (
            self.membership_epoch,
            self.current_version,
            tuple(sorted(self.states.items())),
            tuple(sorted(self.versions.items(), key=lambda kv: kv[0])),
            self.rolling_version,
        )

    def routable_ids(self) -> list[str]:
        """Healthy (or suspect) replicas on the current version, or on the one being rolled out."""
        rolling = self.rolling_version
        return [
            rid
            for rid, state in self.states.items()
            if state in (HealthState.HEALTHY.value, HealthState.SUSPECT.value)
            and (
                self.versions.get(rid) == self.current_version
                or (rolling is not None and self.versions.get(rid) == rolling)
            )
        ]

    def describe(self) -> str:
        """One line naming each replica's state and version, and why: what an error says when no
        replica is routable (``replica-0 dead v3 (probe failed (2x): TimeoutError); ...``)."""
        parts = []
        for rid in sorted(self.states):
            why = self.details.get(rid)
            parts.append(f"{rid} {self.states[rid]} v{self.versions.get(rid)}" + (f" ({why})" if why else ""))
        rolling = f", rolling to v{self.rolling_version}" if self.rolling_version is not None else ""
        return f"fleet on v{self.current_version}{rolling}: " + "; ".join(parts or ["no replicas"])

    def preferred_ids(self) -> Optional[list[str]]:
        """During a rolling update, the routable replicas already on the new version (where new
        trajectories should start, so that fewer tokens are sampled by weights on their way out);
        None otherwise."""
        if self.rolling_version is None:
            return None
        return [rid for rid in self.routable_ids() if self.versions.get(rid) == self.rolling_version]


__all__ = ["HealthState", "ReplicaState", "ALLOWED_TRANSITIONS", "can_transition", "ReplicaRecord", "FleetSnapshot"]
