"""What the fleet controller publishes to clients (a base of :class:`FleetController`).

Clients route by :class:`FleetSnapshot` records: membership (with handles only when it changed
since the client's epoch), health states, weight versions and loads. They watch for them (a long
poll) rather than poll, so a change reaches every client at once and a quiet fleet costs one call
per client per refresh. A client's first snapshot carries loads asked for afresh.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Optional

from rollfleet.health import FleetSnapshot, ReplicaRecord
from rollfleet.server.direct import DirectHandle

if TYPE_CHECKING:
    from rollfleet.config import RolloutConfig


class SnapshotPublisher:
    """Snapshots and the long poll. Needs from its subclass: ``config``, ``_records``,
    ``_membership_epoch``, ``current_version``, ``_rolling_version``, ``_changes``, ``_changed``,
    ``fresh_loads`` (:class:`~rollfleet.manager.supervision.HealthSupervisor`)."""

    config: RolloutConfig
    _records: dict[str, ReplicaRecord]
    _membership_epoch: int
    current_version: Optional[int]
    _rolling_version: Optional[int]
    _changes: tuple[str, int]
    _changed: Optional[asyncio.Event]

    if TYPE_CHECKING:

        async def fresh_loads(self) -> None: ...

    async def snapshot(self, known_epoch: int = -1, client_id: Optional[str] = None) -> FleetSnapshot:
        """What clients route by; loads carry ``client_id``'s share of each replica's in-flight
        requests only (each client needs its own; all clients' would grow with the fleet). A
        client's first (``known_epoch`` -1) gets loads asked for afresh (:meth:`fresh_loads`)."""
        if known_epoch == -1:
            await self.fresh_loads()
        return self._snapshot(known_epoch, client_id)

    def _snapshot(self, known_epoch: int, client_id: Optional[str]) -> FleetSnapshot:
        records = self._records
        snap = FleetSnapshot(
            membership_epoch=self._membership_epoch,
            current_version=self.current_version,
            states={rid: r.state.value for rid, r in records.items()},
            versions={rid: r.weight_version for rid, r in records.items()},
            loads={rid: r.load.for_client(client_id) for rid, r in records.items() if r.load is not None},
            rolling_version=self._rolling_version,
            details={rid: r.detail for rid, r in records.items() if r.detail},
            seq=self._changes,
        )
        if known_epoch != self._membership_epoch:
            snap.handles = {rid: _route_handle(r, self.config.data_plane_pickle) for rid, r in records.items()}
        return snap

    async def watch(
        self,
        known_epoch: int = -1,
        known_signature: Optional[tuple] = None,
        timeout_s: float = 1.0,
        client_id: Optional[str] = None,
    ) -> FleetSnapshot:
        """Long poll: the snapshot as soon as what routing depends on (membership, states,
        versions) differs from ``known_signature``, else after ``timeout_s`` (with fresh loads).

        Clients watch instead of polling: a change reaches every client at once, and a quiet fleet
        costs one call per client per ``timeout_s`` (a snapshot call costs the controller and
        the caller milliseconds of CPU; hundreds of workers polling 4 times a second would
        saturate this actor).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(timeout_s, 60.0))
        if known_epoch == -1:
            await self.fresh_loads()
        while True:
            snap = self._snapshot(known_epoch, client_id)
            remaining = deadline - loop.time()
            if snap.signature() != known_signature or remaining <= 0:
                return snap
            try:
                await asyncio.wait_for(self._change_event().wait(), remaining)
            except asyncio.TimeoutError:
                pass

    def _change_event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        """Wake every watcher (they compare signatures and go back to waiting if nothing that
        matters changed)."""
        event, self._changed = self._changed, None
        self._changes = (self._changes[0], self._changes[1] + 1)
        if event is not None:
            event.set()


def _route_handle(record: ReplicaRecord, allow_pickle: bool = False) -> Any:
    """The handle clients route requests to: generate over the replica's data plane when it has
    one, every other call through its Ray actor."""
    if record.data_plane:
        token = record.data_plane_token
        return DirectHandle(record.handle, record.data_plane, record.replica_id, token, allow_pickle)
    return record.handle


__all__ = ["SnapshotPublisher"]
