"""How a replica joins the fleet (a base of :class:`FleetController`): placed, started, brought to
the current weights and to what the fleet's owner last asked of the fleet, then marked healthy.

The same path serves a first launch, ``add_replicas`` and every restart. The weights are loaded
twice over: first outside the update lock (a big model loads for seconds; the trainer's updates
must not wait for it), then under it whatever was published meanwhile, so the replica turns
healthy exactly on the version the fleet publishes. Every call made under the lock is bounded by
the limit a live replica gets for the same call (``weight_sync.stage_timeout_s`` +
``commit_timeout_s`` for a load, ``health.control_timeout_s`` for a check or a pause): a starting
replica that hangs there fails its start, to be tried again, instead of holding the trainer's next
update for up to ``health.start_timeout_s``.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, TypeVar

from rollfleet.health import HealthState, ReplicaRecord
from rollfleet.manager.fanout import ControlTimeout
from rollfleet.records import ReplicaInfo

if TYPE_CHECKING:
    from rollfleet.config import RolloutConfig
    from rollfleet.manager.placement import Placer, ReplicaPlacement

T = TypeVar("T")

_INFO_FIELDS = ("replica_id", "state", "address", "server_socket", "weight_version", "restarts", "node_id", "node_ip",
                "devices", "handle")  # fmt: skip


def replica_info(record: ReplicaRecord) -> ReplicaInfo:
    """What callers are told of a replica (its record less the controller's bookkeeping)."""
    return ReplicaInfo(**{name: getattr(record, name) for name in _INFO_FIELDS})


async def bounded(rid: str, what: str, call: Awaitable[T], timeout_s: float) -> T:
    """``call``'s result, or :class:`ControlTimeout` naming the replica, the call and the limit."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        raise ControlTimeout(f"{what} on starting {rid} took over {timeout_s:g}s") from None


class ReplicaStarter:
    """Places, starts and syncs one replica. Needs from its subclass: ``config``, ``_placer``,
    ``_records``, ``_indices``, the weight state, ``_update_lock``, ``_set_state``,
    ``_membership_changed``, ``_dead_nodes``, ``_bring_to_hold`` and ``_spawn``."""

    # What the subclass provides, declared for the type checker (set in its ``__init__``).
    config: RolloutConfig
    _placer: Optional[Placer]
    _records: dict[str, ReplicaRecord]
    current_version: Optional[int]
    _weights: Any
    _has_weights: bool
    _checksum: Optional[str]
    _published_unverified: bool
    _update_lock: asyncio.Lock

    if TYPE_CHECKING:

        def _set_state(self, record: ReplicaRecord, state: HealthState, detail: str, force: bool = False) -> None: ...

        def _membership_changed(self) -> None: ...

        async def _dead_nodes(self) -> set[str]: ...

        def _spawn(self, rid: str, placement: Optional[ReplicaPlacement]) -> Any: ...

        async def _bring_to_hold(self, call: Callable[[str], Awaitable[Any]]) -> None: ...

    async def _place(self, rid: str) -> Optional[ReplicaPlacement]:
        """The replica's placement group: kept across restarts while its node lives, else a new one."""
        if self._placer is None:
            return None
        current = self._placer.placements.get(rid)
        if current is not None:
            if current.node_id not in await self._dead_nodes():
                return current
            self._placer.release(rid)
        placement = self.config.placement
        fraction = 1.0 - placement.colocate_fraction if placement.colocate else 1.0
        return await self._placer.reserve(rid, fraction)

    async def _start_replica(self, rid: str) -> ReplicaInfo:
        placement = await self._place(rid)
        handle = self._spawn(rid, placement)
        # The record takes the new actor with no await in between: whoever stops this replica
        # (a removal, a shutdown, a failed start) stops the actor just spawned.
        record = self._records.get(rid)
        if record is None:
            record = ReplicaRecord(replica_id=rid, handle=handle, state=HealthState.SYNCING)
            self._records[rid] = record
        else:
            record.handle = handle
            record.data_plane = ""  # the old actor's port is gone; the new one reports its own
            record.load = None  # the dead actor's load: clients counted it as the new one's (phantom load)
            self._set_state(record, HealthState.SYNCING, "placed; starting, then loading current weights")
        record.placement = placement
        record.node_id = placement.node_id if placement is not None else ""
        self._membership_changed()
        # The version the engine boots with is decided now: an update may land while it starts
        # (vLLM takes ~45 s), and then _catch_up must still load the new weights.
        boot_version = None if self._has_weights else self.current_version
        if placement is not None and self._placer is not None:
            info = await handle.start.remote(boot_version, await self._placer.devices_of(placement))
        else:
            info = await handle.start.remote(boot_version)
        record.address = info.get("address", "")
        record.server_socket = info.get("server_socket") or ""
        record.node_ip = info.get("node_ip") or ""
        record.devices = info.get("devices")
        record.data_plane = info.get("data_plane") or ""
        record.data_plane_token = info.pop("data_plane_token", None) or ""
        record.weight_version = boot_version
        # Never serve stale weights: the current ones first, outside the update lock, then under it
        # what was published meanwhile (updates skip a replica not yet live).
        await self._catch_up(record, handle)
        control_s = self.config.health.control_timeout_s
        sync = self.config.weight_sync
        async with self._update_lock:
            await self._catch_up(record, handle, timeout_s=sync.stage_timeout_s + sync.commit_timeout_s)
            if self._checksum is not None or self._published_unverified:
                report = await bounded(rid, "weights_checksum", handle.weights_checksum.remote(), control_s)
                if self._checksum is None:  # published with no replica live: the first one back sets it
                    self._checksum = report["checksum"]
                    self._published_unverified = report["checksum"] is None
                elif report["checksum"] not in (None, self._checksum):
                    raise RuntimeError(
                        f"{rid}: weights checksum {report['checksum']} differs from the fleet's {self._checksum}"
                    )

            async def hold_call(method: str) -> Any:
                return await bounded(rid, method, getattr(handle, method).remote(), control_s)

            await self._bring_to_hold(hold_call)  # the fleet may be paused or asleep (the learner holds the devices)
            record.consecutive_failures = 0
            record.answered_at = time.monotonic()
            self._set_state(record, HealthState.HEALTHY, "started")
        self._membership_changed()
        return replica_info(record)

    async def _catch_up(self, record: ReplicaRecord, handle: Any, timeout_s: Optional[float] = None) -> None:
        """Load the fleet's weights on a starting replica until it has the current version (an
        update may publish while it loads; weights and version are published together). Each
        load within ``timeout_s`` when given."""
        while record.weight_version != self.current_version:
            version, weights = self.current_version, self._weights
            load = handle.update_weights.remote(weights, version)
            if timeout_s is None:
                await load
            else:
                await bounded(record.replica_id, "update_weights", load, timeout_s)
            record.weight_version = version


__all__ = ["ReplicaStarter", "bounded", "replica_info"]
