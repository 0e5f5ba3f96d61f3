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
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

from rollfleet.config import RolloutConfig
from rollfleet.errors import FleetOperationFailed, InvalidRequest, NotSupported
from rollfleet.health import HealthState, ReplicaRecord
from rollfleet.utils.aio import run_to_end
from rollfleet.utils.refs import awaited

#: What a replica raises when the caller asked for something it cannot do, not because it failed:
#: every replica would answer the same, so nothing is fenced and the error goes back as is.
CALLER_ERRORS = (NotSupported, InvalidRequest, ValueError, TypeError)


def caller_mistake(results: list[Any]) -> Optional[BaseException]:
    """A refusal of :data:`CALLER_ERRORS` to raise as is, when no replica did the operation; where
    one did, a replica that refused has a fault of its own (fenced: it cannot stop the fleet)."""
    if any(not isinstance(res, BaseException) for res in results):
        return None
    return next((res for res in results if isinstance(res, CALLER_ERRORS)), None)


class ControlTimeout(asyncio.TimeoutError):
    """A replica did not finish a control call in time (it is fenced)."""


class ReplicaGone(RuntimeError):
    """The replica was declared dead (by the prober) while a control call waited for it."""


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
    _published_unverified: bool
    _rolling_version: Optional[int]
    _update_lock: asyncio.Lock

    if TYPE_CHECKING:

        def _set_state(self, record: ReplicaRecord, state: HealthState, detail: str, force: bool = False) -> None: ...

        def _schedule_restart(self, record: ReplicaRecord) -> None: ...

        def _notify(self) -> None: ...

    def _live(self) -> list[ReplicaRecord]:
        return [r for r in self._records.values() if r.state in (HealthState.HEALTHY, HealthState.SUSPECT)]

    async def _call(self, record: ReplicaRecord, method: str, *args: Any, timeout_s: float, **kwargs: Any) -> Any:
        """One replica's answer to ``method``, or the error it failed with (a timeout included):
        never raises, so that one hung or dead replica cannot fail or stall a fleet-wide call."""
        try:
            return await asyncio.wait_for(awaited(getattr(record.handle, method).remote(*args, **kwargs)), timeout_s)
        except asyncio.TimeoutError:
            return ControlTimeout(f"{method} on {record.replica_id} took over {timeout_s:g}s")
        except Exception as exc:
            return getattr(exc, "cause", None) or exc  # Ray's wrapper -> the replica's own error

    async def _gather(
        self, records: list[ReplicaRecord], method: str, *args: Any, timeout_s: float, **kwargs: Any
    ) -> list[Any]:
        """``method`` on each of ``records`` at once, each answer or error in order. A replica the
        prober declares dead meanwhile is not waited for any longer (a hung process is given up
        on within a few probes, not after ``timeout_s``)."""
        tasks = [asyncio.ensure_future(self._call(r, method, *args, timeout_s=timeout_s, **kwargs)) for r in records]
        results: list[Any] = [None] * len(tasks)
        handles = [r.handle for r in records]
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=self.config.health.probe_interval_s)
            for i, (r, task) in enumerate(zip(records, tasks)):
                gone = r.handle is not handles[i] or r.state not in (HealthState.HEALTHY, HealthState.SUSPECT)
                if task in pending and gone:
                    task.cancel()
                    pending.discard(task)
                    results[i] = ReplicaGone(f"{method} on {r.replica_id} abandoned: {r.state.value} ({r.detail})")
        for i, task in enumerate(tasks):
            if results[i] is None:
                results[i] = task.result()
        return results

    async def _fan_out(
        self, method: str, *args: Any, timeout_s: Optional[float] = None, **kwargs: Any
    ) -> dict[str, Any]:
        records = self._live()
        timeout = timeout_s if timeout_s is not None else self.config.health.control_timeout_s
        results = await self._gather(records, method, *args, timeout_s=timeout, **kwargs)
        return {r.replica_id: res for r, res in zip(records, results)}

    def _settle(self, results: dict[str, Any], op: str) -> dict[str, Any]:
        """Decide a fan-out: a caller's mistake (``NotSupported``, a bad argument) is raised as is
        (:func:`caller_mistake`); any other failure or timeout fences that replica (dead,
        restarted on the current weights) and the operation stands on the others. Raises
        :class:`FleetOperationFailed` only when no replica could do it."""
        mistake = caller_mistake(list(results.values()))
        if mistake is not None:
            raise mistake
        errors = {rid: res for rid, res in results.items() if isinstance(res, BaseException)}
        fenced = {rid: repr(exc) for rid, exc in errors.items()}
        for rid, reason in fenced.items():
            record = self._records.get(rid)
            if record is not None and record.state in (HealthState.HEALTHY, HealthState.SUSPECT):
                self._fail(record, f"{op} failed: {reason}")
        if fenced and len(fenced) == len(results):
            raise FleetOperationFailed(op, fenced)
        return {"ok": sorted(rid for rid in results if rid not in errors), "fenced": fenced}

    async def _op(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Fan ``method`` out to the live replicas and settle it: ``{"ok": [...], "fenced": {...}}``."""
        return self._settle(await self._fan_out(method, *args, **kwargs), method)

    async def abort_all(self) -> dict[str, Any]:
        results = await self._fan_out("abort_all")
        report = self._settle(results, "abort_all")
        counts = {rid: res for rid, res in results.items() if rid in report["ok"]}
        return {"aborted_count": sum(counts.values()), "server_results": counts, "fenced": report["fenced"]}

    #: What the fleet's owner last asked of the whole fleet: None (serving), "paused" or
    #: "sleeping". A replica restarted meanwhile is brought to it before it counts as healthy. It
    #: is set before the op fans out: a replica that goes live after the op took its list of live
    #: ones then finds it (:meth:`_bring_to_hold`), instead of staying as the old one left it.
    _hold: Optional[str] = None

    async def pause(self) -> dict[str, Any]:
        return await self._held_op(self._hold or "paused", "pause")

    async def resume(self) -> dict[str, Any]:
        return await self._held_op(None, "resume")

    async def sleep(self) -> dict[str, Any]:
        return await self._held_op("sleeping", "sleep")

    async def wake_up(self) -> dict[str, Any]:
        return await self._held_op("paused" if self._hold is not None else None, "wake_up")  # awake, not generating

    async def _held_op(self, hold: Optional[str], method: str) -> dict[str, Any]:
        """Set :attr:`_hold`, then fan ``method`` out. Refused as a caller's mistake (vLLM's CPU build
        cannot sleep), the fleet stays as it was, and so does the hold that restarts are brought to."""
        before, self._hold = self._hold, hold
        try:
            return await self._op(method)
        except CALLER_ERRORS:
            if self._hold == hold:
                self._hold = before
            raise

    async def _bring_to_hold(self, call: Callable[[str], Awaitable[Any]]) -> None:
        """Bring a starting replica (serving, awake) to :attr:`_hold`, again if it changed while
        this ran: the caller marks the replica healthy, with no await between, once it holds.
        ``call(method)`` makes each call on the replica (the caller bounds them)."""
        reached: Optional[str] = None
        while reached != self._hold:
            target = self._hold
            if target is None:
                await call("resume")  # wakes a sleeping one first
            elif reached == "sleeping":  # asked to wake up: awake, still paused
                await call("wake_up")
            else:
                await call("pause")
                if target == "sleeping":
                    await call("sleep")
            reached = target

    async def clear_kv_cache(self) -> dict[str, Any]:
        return await self._op("clear_kv_cache")

    async def start_profile(self, **kwargs: Any) -> dict[str, Any]:
        return await self._op("start_profile", **kwargs)

    async def stop_profile(self) -> dict[str, Any]:
        results = await self._fan_out("stop_profile")
        report = self._settle(results, "stop_profile")
        return {rid: res for rid, res in results.items() if rid in report["ok"]}

    async def script_responses(self, script: Any) -> dict[str, Any]:
        """Test hook: let ``script`` choose every response's tokens on every replica (sim engine)."""
        return await self._op("script_responses", script)

    async def update_weights(self, weights: Any, version: int, mode: Optional[str] = None) -> dict[str, Any]:
        """Stage ``weights`` on every live replica, then commit ``version`` (``mode``: the
        configured ``rollout.weight_sync.mode`` unless given). Returns what happened and when:
        ``pause_s`` (the longest a replica generated nothing), ``paused`` (``[start, end]`` wall
        times of each commit wave), ``stage_s``, ``commit_s`` (``verify_s`` of it: the checksum
        round after the commits), ``total_s``, ``modes`` used.

        A caller that gives up (cancelled, timed out, ``ray.cancel``) does not stop the update:
        it runs to its end and publishes. Stopped half-way, replicas would run weights the fleet
        does not know they have (committed, still labelled with the old version), and one
        restarted meanwhile would load the old weights beside them unnoticed. It is bounded by
        the stage and commit timeouts."""
        return await run_to_end(
            self._update_weights(weights, version, mode),
            "a weight update",
            lambda r: f"published version {r['version']}",
        )

    def _wave_size(self, ready: int) -> int:
        """A rolling wave: ``max_unavailable`` of the fleet (draining aside), less the replicas out
        of service already (not ``ready``: dead, restarting, fenced while staging), at least one."""
        members = [r for r in self._records.values() if r.state != HealthState.DRAINING]
        allowance = math.floor(self.config.weight_sync.max_unavailable * len(members))
        return max(1, allowance - (len(members) - ready))

    async def _update_weights(self, weights: Any, version: int, mode: Optional[str]) -> dict[str, Any]:
        if isinstance(weights, WeightsRef):
            weights = weights.ref
        sync = self.config.weight_sync
        mode = mode or sync.mode
        if mode not in ("abort", "keep", "rolling"):
            raise ValueError(f"weight_sync.mode must be abort, keep or rolling, got {mode!r}")
        if isinstance(version, bool) or not isinstance(version, int):  # stamped on every token
            raise InvalidRequest("version", "an integer", version)
        async with self._update_lock:
            if self.current_version is not None and version <= self.current_version:
                raise ValueError(f"weight version must increase: {version} <= current {self.current_version}")
            started = time.monotonic()
            records = self._live()
            fenced: dict[str, str] = {}
            handles = {r.replica_id: r.handle for r in records}  # the actors this update talks to
            staged = await self._gather(records, "stage_weights", weights, version, timeout_s=sync.stage_timeout_s)
            # Weights every replica refuses alike (a bad state dict, a version the engine rejects)
            # are the caller's to fix: nothing is committed, nothing is fenced.
            mistake = caller_mistake(staged)
            if mistake is not None:
                raise mistake
            ready = []
            for r, res in zip(records, staged):
                if isinstance(res, BaseException):
                    self._fence(r, fenced, f"weight staging failed: {res!r}", handles)
                else:
                    ready.append(r)
            stage_done = time.monotonic()
            wave_size = max(1, len(ready)) if mode != "rolling" else self._wave_size(len(ready))
            commit_mode = "abort" if mode == "abort" else "keep"
            paused: list[list[float]] = []
            modes: dict[str, str] = {}
            longest = 0.0
            if mode == "rolling":  # replicas on either version serve meanwhile; new work prefers the new one
                self._rolling_version = version
            try:
                for i in range(0, len(ready), wave_size):
                    # Each replica pauses only for its own commit: one that hangs holds up this
                    # call (up to commit_timeout_s), never the others' generation.
                    wave = [r for r in ready[i : i + wave_size] if r.replica_id not in fenced]
                    wave_start = time.time()
                    results = await self._gather(
                        wave, "commit_weights", version, commit_mode, timeout_s=sync.commit_timeout_s
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
                            self._fence(r, fenced, f"weight commit failed: {res!r}", handles)
                        else:
                            if mode == "rolling":  # routable as the new version from its wave on
                                r.weight_version = version
                            modes[r.replica_id] = res["mode"]
                            longest = max(longest, res["pause_s"])
                    if mode == "rolling":
                        self._notify()  # clients route new trajectories to this wave at once
                verify_start = time.monotonic()
                committed = [r for r in ready if r.replica_id not in fenced]
                checksum = await self._verify(committed, fenced, version, handles)
                verify_s = time.monotonic() - verify_start
            finally:
                self._rolling_version = None
            if records and len(fenced) == len(records):
                # No replica took it: the fleet stays on the old version (the fenced replicas come
                # back on it) and the caller learns why from each replica.
                raise FleetOperationFailed("update_weights", fenced)
            # Publish atomically (no await between): every replica that has the new weights is
            # routable under the new version, the others are not. Until now (the checksum round
            # included) the committed replicas stayed routable under the old label, so new work
            # never found the fleet empty; their tokens carry the engine's own version labels.
            for r in committed:
                if r.replica_id not in fenced:
                    r.weight_version = version
            self._checksum = checksum
            self._published_unverified = not records  # no replica to check: the first one back will
            self._weights = weights
            self._has_weights = True
            self.current_version = version
            self._notify()
            done = time.monotonic()
            return {
                "version": version,
                "mode": mode,
                "replicas": len(records),
                "failed": list(fenced),
                "fenced": fenced,
                "modes": modes,
                "waves": len(paused),
                "paused": paused,
                "pause_s": longest,
                "checksum": checksum,
                "stage_s": stage_done - started,
                "commit_s": done - stage_done,
                "verify_s": verify_s,
                "total_s": done - started,
            }

    async def _verify(
        self, committed: list[ReplicaRecord], fenced: dict[str, str], version: int, handles: dict[str, Any]
    ) -> Optional[str]:
        """Every committed replica must report ``version`` and the weight digest more than half of
        them report; one that disagrees never serves on: it is restarted from the reference. With
        no strict majority (two replicas that differ, a three-way split) no digest can be trusted,
        so none is kept: every committed replica is fenced and the update fails."""
        timeout = self.config.health.control_timeout_s
        reports = await self._gather(committed, "weights_checksum", timeout_s=timeout)
        digests = [rep["checksum"] for rep in reports if isinstance(rep, dict) and rep["checksum"] is not None]
        majority: Optional[str] = None
        if digests:
            digest, count = Counter(digests).most_common(1)[0]
            majority = digest if 2 * count > len(digests) else None
        for r, rep in zip(committed, reports):
            if isinstance(rep, BaseException):
                problem = f"weights check failed: {rep!r}"
            elif rep["version"] != version:
                problem = f"reports version {rep['version']} after committing {version}"
            elif rep["checksum"] is not None and majority is None:
                problem = f"weights checksum {rep['checksum']}: no digest is shared by most replicas ({len(digests)})"
            elif rep["checksum"] is not None and rep["checksum"] != majority:
                problem = f"weights checksum {rep['checksum']} differs from the fleet's {majority}"
            else:
                continue
            self._fence(r, fenced, problem, handles)
        return majority

    async def weights_checksums(self) -> dict[str, Optional[str]]:
        """Each live replica's weight digest, as its engine reports it (None: it cannot tell):
        equal on every replica after a verified commit. A replica that cannot answer is fenced."""
        results = await self._fan_out("weights_checksum")
        report = self._settle(results, "weights_checksums")
        return {rid: res["checksum"] for rid, res in results.items() if rid in report["ok"]}

    def _fence(self, record: ReplicaRecord, fenced: dict[str, str], detail: str, handles: dict[str, Any]) -> None:
        """Count ``record`` out of this update and, if it is still the actor the update talked to
        and in service, restart it. One the prober already declared dead (its restart under way),
        one being removed (draining) or one already restarted belongs to whoever moved it: failing
        it again would leave a restarted replica dead with no restart pending, or respawn one being
        removed."""
        fenced[record.replica_id] = detail
        if record.handle is handles.get(record.replica_id) and record.state in (
            HealthState.HEALTHY,
            HealthState.SUSPECT,
        ):
            self._fail(record, detail)

    def _fail(self, record: ReplicaRecord, detail: str) -> None:
        self._set_state(record, HealthState.DEAD, detail)
        self._schedule_restart(record)


__all__ = ["ControlFanOut"]
