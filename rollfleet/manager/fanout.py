"""Control operations fanned out to every live replica (a base of :class:`FleetController`).

Weight updates: pause every replica (in-flight requests come back ``aborted`` with their partial
tokens; new ones wait at the replica's gate), load the weights everywhere, clear prefix caches,
stamp the version, then resume in ``finally`` so a failed update never leaves the fleet paused.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Optional

from rollfleet.errors import FleetOperationFailed, NotSupported
from rollfleet.health import HealthState, ReplicaRecord


class ControlFanOut:
    """Pause, resume, sleep, profile, weight updates on every live replica. Needs from its
    subclass: ``_records``, ``_set_state``, ``_schedule_restart``, ``_notify`` and the weight state
    (``current_version``, ``_weights``, ``_has_weights``, ``_update_lock``)."""

    # What the subclass provides, declared for the type checker (set in its ``__init__``).
    _records: dict[str, ReplicaRecord]
    current_version: Optional[int]
    _weights: Any
    _has_weights: bool
    _update_lock: Optional[asyncio.Lock]

    if TYPE_CHECKING:

        def _set_state(self, record: ReplicaRecord, state: HealthState, detail: str, force: bool = False) -> None: ...

        def _schedule_restart(self, record: ReplicaRecord) -> None: ...

        def _notify(self) -> None: ...

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
        """Raise for the replicas where ``op`` failed: the engine's own ``NotSupported`` as is (the
        caller decides, e.g. a fleet that cannot sleep trains awake), else one
        :class:`FleetOperationFailed` naming every failed replica."""
        errors = {rid: res for rid, res in results.items() if isinstance(res, BaseException)}
        if not errors:
            return
        causes = {rid: getattr(exc, "cause", exc) for rid, exc in errors.items()}
        for cause in causes.values():
            if isinstance(cause, NotSupported):
                raise cause
        raise FleetOperationFailed(op, {rid: repr(cause) for rid, cause in causes.items()})

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


__all__ = ["ControlFanOut"]
