"""The fleet controller: the control plane of the fleet, as one asyncio Ray actor.

It launches, probes, restarts and removes replicas, fans control ops (pause, weight updates,
sleep, profile) out to every replica, and publishes :class:`FleetSnapshot` records that clients
poll. It is never on the data plane: generation goes client -> replica directly, so a slow
controller can delay a client's view of the fleet but never a request.

Health: every ``probe_interval_s`` each replica's ``load()`` is called with a timeout. A failed
probe makes a healthy replica ``suspect``; ``failures_to_dead`` in a row make it ``dead``. A dead
replica is restarted (new actor, same id) and stays ``syncing`` until it has the current weights;
only then does it become ``healthy`` and routable again.

Weight updates: pause every replica (in-flight requests come back ``aborted`` with their partial
tokens; new ones wait at the replica's gate), load the weights everywhere, clear prefix caches,
stamp the version, then resume in ``finally`` so a failed update never leaves the fleet paused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

from rollfleet.server.direct import DirectHandle
from rollfleet.config import RolloutConfig
from rollfleet.errors import NotSupported
from rollfleet.health import FleetSnapshot, HealthState, ReplicaRecord, can_transition

logger = logging.getLogger(__name__)

#: Grace given to a replica declared dead to stop its engine before its actor is killed.
STOP_TIMEOUT_DEAD_S = 10.0

#: Builds a replica actor handle: (replica_id, replica_index) -> handle.
ReplicaFactory = Callable[[str, int], Any]


class FleetController:
    def __init__(self, config: RolloutConfig, replica_factory: Optional[ReplicaFactory] = None) -> None:
        self.config = config
        self._factory = replica_factory or _default_factory(config)
        self._records: dict[str, ReplicaRecord] = {}
        self._indices: dict[str, int] = {}
        self._next_index = 0
        self._membership_epoch = 0
        self.current_version: Optional[int] = None
        self._weights: Any = None  # the last weights pushed (an ObjectRef when called through Ray)
        self._has_weights = False  # False: the engines' boot weights are the current version
        self._probe_task: Optional[asyncio.Task[None]] = None
        self._restart_tasks: dict[str, asyncio.Task[None]] = {}
        self._events: list[dict[str, Any]] = []
        self._update_lock: Optional[asyncio.Lock] = None
        self._changed: Optional[asyncio.Event] = None  # set (and replaced) on every change

    # ------------------------------------------------------------------ membership
    async def launch(self, num_replicas: int, initial_version: int = 0) -> list[dict[str, Any]]:
        """Start ``num_replicas`` replicas serving the engine's boot weights as ``initial_version``."""
        if self.current_version is None:
            self.current_version = initial_version
        infos = await self.add_replicas(num_replicas)
        self._ensure_prober()
        return infos

    async def add_replicas(self, n: int) -> list[dict[str, Any]]:
        """Start ``n`` more replicas; each serves only once it has the current weights."""
        ids = []
        for _ in range(n):
            index = self._next_index
            self._next_index += 1
            rid = f"replica-{index}"
            self._indices[rid] = index
            ids.append(rid)
        infos = await asyncio.gather(*(self._start_replica(rid) for rid in ids))
        self._ensure_prober()
        return list(infos)

    async def _start_replica(self, rid: str) -> dict[str, Any]:
        handle = self._factory(rid, self._indices[rid])
        record = self._records.get(rid)
        if record is None:
            record = ReplicaRecord(replica_id=rid, handle=handle, state=HealthState.SYNCING)
            self._records[rid] = record
        else:
            record.handle = handle
            record.data_plane = ""  # the old actor's port is gone; the new one reports its own
        self._membership_changed()
        # The version the engine boots with is decided now: an update may land while it starts
        # (vLLM takes ~45 s), and then the loop below must still load the new weights.
        boot_version = None if self._has_weights else self.current_version
        info = await handle.start.remote(boot_version)
        record.address = info.get("address", "")
        record.data_plane = info.get("data_plane") or ""
        record.data_plane_token = info.pop("data_plane_token", None) or ""
        record.weight_version = boot_version
        # Never serve stale weights: a new or restarted replica loads the current ones first (again
        # if an update landed while it was loading).
        while record.weight_version != self.current_version:
            version = self.current_version
            await handle.update_weights.remote(self._weights, version)
            record.weight_version = version
        record.consecutive_failures = 0
        self._set_state(record, HealthState.HEALTHY, "started")
        self._membership_changed()
        return {**info, "weight_version": self.current_version, "state": record.state.value}

    async def remove_replicas(self, replica_ids: list[str], drain_timeout_s: float = 30.0) -> list[str]:
        """Stop routing to the replicas, let their in-flight work finish (bounded), then stop them."""
        removed = []
        for rid in replica_ids:
            record = self._records.get(rid)
            if record is None:
                continue
            self._set_state(record, HealthState.DRAINING, "removal requested", force=True)
            removed.append(rid)
        self._membership_changed()
        await asyncio.gather(*(self._drain_and_stop(rid, drain_timeout_s) for rid in removed))
        for rid in removed:
            self._records.pop(rid, None)
            task = self._restart_tasks.pop(rid, None)
            if task is not None:
                task.cancel()
        self._membership_changed()
        return removed

    async def _drain_and_stop(self, rid: str, timeout_s: float) -> None:
        record = self._records[rid]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                report = await asyncio.wait_for(record.handle.load.remote(), self.config.health.probe_timeout_s)
            except Exception:
                break
            if report.inflight == 0:
                break
            await asyncio.sleep(0.05)
        await self._stop_handle(record.handle)

    async def _stop_handle(self, handle: Any, timeout_s: float = 30.0) -> None:
        try:
            await asyncio.wait_for(handle.shutdown.remote(), timeout_s)
        except Exception:
            pass
        _kill(handle)

    # ------------------------------------------------------------------ snapshot (polled by clients)
    async def snapshot(self, known_epoch: int = -1) -> FleetSnapshot:
        records = self._records
        snap = FleetSnapshot(
            membership_epoch=self._membership_epoch,
            current_version=self.current_version,
            states={rid: r.state.value for rid, r in records.items()},
            versions={rid: r.weight_version for rid, r in records.items()},
            loads={rid: r.load for rid, r in records.items() if r.load is not None},
        )
        if known_epoch != self._membership_epoch:
            snap.handles = {rid: _route_handle(r) for rid, r in records.items()}
        return snap

    async def watch(
        self, known_epoch: int = -1, known_signature: Optional[tuple] = None, timeout_s: float = 1.0
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
        while True:
            snap = await self.snapshot(known_epoch)
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

    def _membership_changed(self) -> None:
        """A replica was added, removed or got a new actor: clients must fetch handles again."""
        self._membership_epoch += 1
        self._notify()

    def _notify(self) -> None:
        """Wake every watcher (they compare signatures and go back to waiting if nothing that
        matters changed)."""
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    async def get_replicas(self) -> list[dict[str, Any]]:
        return [
            {
                "replica_id": r.replica_id,
                "address": r.address,
                "handle": r.handle,
                "state": r.state.value,
                "weight_version": r.weight_version,
                "restarts": r.restarts,
            }
            for r in self._records.values()
        ]

    async def status(self) -> dict[str, Any]:
        return {
            "current_version": self.current_version,
            "membership_epoch": self._membership_epoch,
            "replicas": {
                r.replica_id: {
                    "state": r.state.value,
                    "address": r.address,
                    "weight_version": r.weight_version,
                    "restarts": r.restarts,
                    "consecutive_failures": r.consecutive_failures,
                    "inflight": r.load.inflight if r.load else None,
                    "kv_usage": r.load.kv_usage if r.load else None,
                    "detail": r.detail,
                }
                for r in self._records.values()
            },
            "events": self._events[-50:],
        }

    async def replica_stats(self) -> dict[str, Any]:
        async def one(r: ReplicaRecord) -> Any:
            try:
                return await asyncio.wait_for(r.handle.stats.remote(), self.config.health.probe_timeout_s)
            except Exception as exc:
                return {"error": repr(exc)}

        records = list(self._records.values())
        results = await asyncio.gather(*(one(r) for r in records))
        return {r.replica_id: s for r, s in zip(records, results)}

    # ------------------------------------------------------------------ health
    def _ensure_prober(self) -> None:
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_forever())

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.health.probe_interval_s)
            try:
                await self.probe_all()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("health probe round failed")

    async def probe_all(self) -> None:
        records = [r for r in self._records.values() if r.state in (HealthState.HEALTHY, HealthState.SUSPECT)]
        await asyncio.gather(*(self._probe(r) for r in records))
        self._notify()  # a safety net: whatever changed without a notification shows now

    async def _probe(self, record: ReplicaRecord) -> None:
        handle = record.handle
        try:
            report = await asyncio.wait_for(handle.load.remote(), self.config.health.probe_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if record.handle is not handle or record.state not in (HealthState.HEALTHY, HealthState.SUSPECT):
                return
            record.consecutive_failures += 1
            detail = f"probe failed ({record.consecutive_failures}x): {type(exc).__name__}"
            if record.consecutive_failures >= self.config.health.failures_to_dead:
                self._set_state(record, HealthState.DEAD, detail)
                self._schedule_restart(record)
            else:
                self._set_state(record, HealthState.SUSPECT, detail)
            return
        if record.handle is not handle:
            return
        record.load = report
        record.consecutive_failures = 0
        if record.state == HealthState.SUSPECT:
            self._set_state(record, HealthState.HEALTHY, "probe ok")

    async def report_failure(self, replica_id: str, reason: str = "") -> None:
        """A client saw a call fail: probe that replica now instead of at the next round."""
        record = self._records.get(replica_id)
        if record is not None and record.state in (HealthState.HEALTHY, HealthState.SUSPECT):
            asyncio.get_running_loop().create_task(self._probe(record))

    def _schedule_restart(self, record: ReplicaRecord) -> None:
        if not self.config.health.auto_restart or record.replica_id in self._restart_tasks:
            return
        task = asyncio.get_running_loop().create_task(self._restart(record.replica_id))
        self._restart_tasks[record.replica_id] = task
        task.add_done_callback(lambda _t, rid=record.replica_id: self._restart_tasks.pop(rid, None))

    async def _restart(self, rid: str) -> None:
        record = self._records.get(rid)
        if record is None:
            return
        # Ask the old replica to stop its engine first: killing the actor outright would orphan
        # an engine subprocess (vLLM's process group) that still holds memory and cores.
        await self._stop_handle(record.handle, timeout_s=STOP_TIMEOUT_DEAD_S)
        record.restarts += 1
        self._set_state(record, HealthState.RESTARTING, f"restart #{record.restarts}")
        try:
            self._set_state(record, HealthState.SYNCING, "started, loading current weights")
            await self._start_replica(rid)
        except Exception as exc:
            logger.exception("restart of %s failed", rid)
            self._set_state(record, HealthState.DEAD, f"restart failed: {exc!r}", force=True)

    def _set_state(self, record: ReplicaRecord, state: HealthState, detail: str, force: bool = False) -> None:
        if not force and not can_transition(record.state, state):
            logger.warning("replica %s: ignoring transition %s -> %s", record.replica_id, record.state, state)
            return
        if record.state != state:
            self._events.append(
                {"t": time.time(), "replica_id": record.replica_id, "from": record.state.value, "to": state.value, "detail": detail}
            )
            del self._events[:-500]
        record.state = state
        record.detail = detail
        self._notify()

    async def inject_fault(self, replica_id: str, kind: str, factor: float = 10.0) -> None:
        await self._records[replica_id].handle.inject_fault.remote(kind, factor)

    # ------------------------------------------------------------------ control fan-out
    def _live(self) -> list[ReplicaRecord]:
        return [r for r in self._records.values() if r.state in (HealthState.HEALTHY, HealthState.SUSPECT)]

    async def _fan_out(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        records = self._live()

        async def call(r: ReplicaRecord) -> Any:
            try:
                return await getattr(r.handle, method).remote(*args, **kwargs)
            except Exception as exc:
                return exc

        results = await asyncio.gather(*(call(r) for r in records))
        return {r.replica_id: res for r, res in zip(records, results)}

    @staticmethod
    def _raise_first(results: dict[str, Any], op: str) -> None:
        errors = {rid: res for rid, res in results.items() if isinstance(res, BaseException)}
        if not errors:
            return
        first = next(iter(errors.values()))
        cause = getattr(first, "cause", first)
        if isinstance(cause, NotSupported):
            raise cause
        raise RuntimeError(f"{op} failed on {sorted(errors)}: {first!r}")

    async def abort_all(self) -> dict[str, Any]:
        results = await self._fan_out("abort_all")
        self._raise_first(results, "abort_all")
        return {"aborted_count": sum(results.values()), "server_results": results}

    async def pause(self) -> None:
        self._raise_first(await self._fan_out("pause"), "pause")

    async def resume(self) -> None:
        self._raise_first(await self._fan_out("resume"), "resume")

    async def sleep(self) -> None:
        self._raise_first(await self._fan_out("sleep"), "sleep")

    async def wake_up(self) -> None:
        self._raise_first(await self._fan_out("wake_up"), "wake_up")

    async def clear_kv_cache(self) -> None:
        self._raise_first(await self._fan_out("clear_kv_cache"), "clear_kv_cache")

    async def start_profile(self, **kwargs: Any) -> None:
        self._raise_first(await self._fan_out("start_profile", **kwargs), "start_profile")

    async def stop_profile(self) -> dict[str, Any]:
        results = await self._fan_out("stop_profile")
        self._raise_first(results, "stop_profile")
        return results

    async def script_responses(self, script: Any) -> None:
        """Test hook: let ``script`` choose every response's tokens on every replica (sim engine)."""
        self._raise_first(await self._fan_out("script_responses", script), "script_responses")

    async def update_weights(self, weights: Any, version: int) -> dict[str, Any]:
        """pause -> update -> clear cache -> stamp version -> resume, on every live replica."""
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            if self.current_version is not None and version <= self.current_version:
                raise ValueError(f"weight version must increase: {version} <= current {self.current_version}")
            started = time.monotonic()
            records = self._live()
            try:
                await asyncio.gather(*(r.handle.pause.remote() for r in records))
                paused = time.monotonic()
                results = await asyncio.gather(
                    *(r.handle.update_weights.remote(weights, version, resume=False) for r in records),
                    return_exceptions=True,
                )
                failed = []
                for r, res in zip(records, results):
                    if isinstance(res, BaseException):
                        failed.append(r.replica_id)
                        self._set_state(r, HealthState.DEAD, f"weight update failed: {res!r}")
                        self._schedule_restart(r)
                    else:
                        r.weight_version = version
                # Publish atomically (no await between): every replica that has the new weights
                # is routable under the new version, the others are not.
                self._weights = weights
                self._has_weights = True
                self.current_version = version
                self._notify()
                loaded = time.monotonic()
            finally:
                await asyncio.gather(*(r.handle.resume.remote() for r in records), return_exceptions=True)
            return {
                "version": version,
                "replicas": len(records),
                "failed": failed,
                "pause_s": paused - started,
                "load_s": loaded - paused,
                "total_s": time.monotonic() - started,
            }

    async def shutdown(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
        for task in list(self._restart_tasks.values()):
            task.cancel()
        await asyncio.gather(*(self._stop_handle(r.handle) for r in self._records.values()), return_exceptions=True)
        self._records.clear()
        self._membership_changed()


def _route_handle(record: ReplicaRecord) -> Any:
    """The handle clients route requests to: generate over the replica's data plane when it has
    one, every other call through its Ray actor."""
    if record.data_plane:
        return DirectHandle(record.handle, record.data_plane, record.replica_id, record.data_plane_token)
    return record.handle


def _kill(handle: Any) -> None:
    try:
        import ray

        ray.kill(handle, no_restart=True)
    except Exception:
        pass


def _default_factory(config: RolloutConfig) -> ReplicaFactory:
    from rollfleet.server.replica import ReplicaActor

    options: dict[str, Any] = {"num_cpus": 0}

    def make(replica_id: str, index: int) -> Any:
        return ReplicaActor.options(name=None, **options).remote(replica_id, config, index)

    return make


try:
    import ray

    @ray.remote(num_cpus=0, max_concurrency=10_000)
    class FleetControllerActor(FleetController):
        """Ray actor around :class:`FleetController` (asyncio; one per fleet)."""

except ImportError:  # pragma: no cover
    FleetControllerActor = None  # type: ignore[assignment,misc]


__all__ = ["FleetController", "FleetControllerActor", "ReplicaFactory"]
