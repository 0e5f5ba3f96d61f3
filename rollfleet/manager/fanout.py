"""Control operations fanned out to every live replica (a base of :class:`FleetController`).

Weight updates come in two phases (``rollout.weight_sync``):

* **stage**: every replica fetches the weights while the fleet keeps generating. They were put
  in Ray's object store once by the trainer; the controller passes the *reference* on (Ray moves
  the bytes to each node once, where the replica resolves it) and keeps only the reference, to
  bring restarted replicas up to date: its memory does not grow with the model or the syncs.
* **commit**: each engine loads what it staged. ``keep``: in-flight requests are frozen with their
  KV cache and continue on the new weights; ``abort``: they come back ``aborted`` with their
  partial tokens and clients resume them; ``rolling``: replicas commit in waves of
  ``max_unavailable`` of the fleet, so the rest keeps generating throughout.

A replica whose stage or commit fails is marked dead and restarted; it comes back on the committed
version (see the controller's start-up path). The version is published only after the commit.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from rollfleet.config import RolloutConfig
from rollfleet.errors import FleetOperationFailed, NotSupported
from rollfleet.health import HealthState, ReplicaRecord


@dataclass(frozen=True)
class WeightsRef:
    """Weights in Ray's object store, boxed so that Ray hands the controller the reference and not
    the bytes (it resolves only top-level ``ObjectRef`` arguments)."""

    ref: Any


class ControlFanOut:
    """Pause, resume, sleep, profile, weight updates on every live replica. Needs from its
    subclass: ``_records``, ``_set_state``, ``_schedule_restart``, ``_notify`` and the weight state
    (``current_version``, ``_weights``, ``_has_weights``, ``_update_lock``)."""

    # What the subclass provides, declared for the type checker (set in its ``__init__``).
    config: RolloutConfig
    _records: dict[str, ReplicaRecord]
    current_version: Optional[int]
    _weights: Any
    _has_weights: bool
    _checksum: Optional[str]
    _rolling_version: Optional[int]
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

    async def update_weights(self, weights: Any, version: int, mode: Optional[str] = None) -> dict[str, Any]:
        """Stage ``weights`` on every live replica, then commit ``version`` (``mode``: the
        configured ``rollout.weight_sync.mode`` unless given). Returns what happened and when:
        ``pause_s`` (the longest a replica generated nothing), ``paused`` (``[start, end]`` wall
        times of each commit wave), ``stage_s``, ``commit_s``, ``total_s``, ``modes`` used."""
        if isinstance(weights, WeightsRef):
            weights = weights.ref
        sync = self.config.weight_sync
        mode = mode or sync.mode
        if mode not in ("abort", "keep", "rolling"):
            raise ValueError(f"weight_sync.mode must be abort, keep or rolling, got {mode!r}")
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            if self.current_version is not None and version <= self.current_version:
                raise ValueError(f"weight version must increase: {version} <= current {self.current_version}")
            started = time.monotonic()
            records = self._live()
            failed: list[str] = []
            staged = await asyncio.gather(
                *(r.handle.stage_weights.remote(weights, version) for r in records), return_exceptions=True
            )
            ready = []
            for r, res in zip(records, staged):
                if isinstance(res, BaseException):
                    failed.append(r.replica_id)
                    self._fail(r, f"weight staging failed: {res!r}")
                else:
                    ready.append(r)
            stage_done = time.monotonic()
            wave_size = len(ready) if mode != "rolling" else max(1, math.floor(sync.max_unavailable * len(ready)))
            commit_mode = "abort" if mode == "abort" else "keep"
            paused: list[list[float]] = []
            modes: dict[str, str] = {}
            longest = 0.0
            if mode == "rolling":  # replicas on either version serve meanwhile; new work prefers the new one
                self._rolling_version = version
            try:
                for i in range(0, len(ready), wave_size):
                    wave = ready[i : i + wave_size]
                    wave_start = time.time()
                    results = await asyncio.gather(
                        *(r.handle.commit_weights.remote(version, commit_mode) for r in wave), return_exceptions=True
                    )
                    windows = [res["window"] for res in results if isinstance(res, dict) and res.get("window")]
                    # the span in which a replica of this wave was paused (else the whole call)
                    paused.append(
                        [min(w[0] for w in windows), max(w[1] for w in windows)]
                        if windows
                        else [wave_start, time.time()]
                    )
                    for r, res in zip(wave, results):
                        if isinstance(res, BaseException):
                            failed.append(r.replica_id)
                            self._fail(r, f"weight commit failed: {res!r}")
                        else:
                            r.weight_version = version
                            modes[r.replica_id] = res["mode"]
                            longest = max(longest, res["pause_s"])
                    if mode == "rolling":
                        self._notify()  # clients route new trajectories to this wave at once
                checksum = await self._verify(ready, failed, version)
            finally:
                self._rolling_version = None
            # Publish atomically (no await between): every replica that has the new weights is
            # routable under the new version, the others are not.
            self._checksum = checksum
            self._weights = weights
            self._has_weights = True
            self.current_version = version
            self._notify()
            done = time.monotonic()
            return {
                "version": version,
                "mode": mode,
                "replicas": len(records),
                "failed": failed,
                "modes": modes,
                "waves": len(paused),
                "paused": paused,
                "pause_s": longest,
                "checksum": checksum,
                "stage_s": stage_done - started,
                "commit_s": done - stage_done,
                "total_s": done - started,
            }

    async def _verify(self, ready: list[ReplicaRecord], failed: list[str], version: int) -> Optional[str]:
        """Every committed replica must report ``version`` and the weight digest most of them
        report; one that disagrees never serves on: it is restarted from the reference."""
        committed = [r for r in ready if r.replica_id not in failed]
        reports = await asyncio.gather(*(r.handle.weights_checksum.remote() for r in committed), return_exceptions=True)
        digests = [rep["checksum"] for rep in reports if isinstance(rep, dict) and rep["checksum"] is not None]
        majority = Counter(digests).most_common(1)[0][0] if digests else None
        for r, rep in zip(committed, reports):
            if isinstance(rep, BaseException):
                problem = f"weights check failed: {rep!r}"
            elif rep["version"] != version:
                problem = f"reports version {rep['version']} after committing {version}"
            elif rep["checksum"] is not None and rep["checksum"] != majority:
                problem = f"weights checksum {rep['checksum']} differs from the fleet's {majority}"
            else:
                continue
            failed.append(r.replica_id)
            self._fail(r, problem)
        return majority

    async def weights_checksums(self) -> dict[str, Optional[str]]:
        """Each live replica's weight digest, as its engine reports it (None: it cannot tell):
        equal on every replica after a verified commit."""
        results = await self._fan_out("weights_checksum")
        self._raise_first(results, "weights_checksums")
        return {rid: res["checksum"] for rid, res in results.items() if isinstance(res, dict)}

    def _fail(self, record: ReplicaRecord, detail: str) -> None:
        self._set_state(record, HealthState.DEAD, detail)
        self._schedule_restart(record)


__all__ = ["ControlFanOut"]
