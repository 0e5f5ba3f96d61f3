"""Control operations fanned out to every live replica (a base of :class:`FleetController`):
pause, resume, sleep, wake-up, profile, each answered per replica so that one hung or dead replica
cannot fail or stall the fleet's call. Weight updates, built on them, are
:mod:`rollfleet.manager.weight_updates`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

from rollfleet.config import RolloutConfig
from rollfleet.errors import FleetOperationFailed, InvalidRequest, NotSupported
from rollfleet.health import HealthState, ReplicaRecord
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
    """Pause, resume, sleep, profile on every live replica. Needs from its
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

    async def _call(
        self, record: ReplicaRecord, method: str, *args: Any, timeout_s: float, handle: Any = None, **kwargs: Any
    ) -> Any:
        """One replica's answer to ``method``, or the error it failed with (a timeout included):
        never raises, so that one hung or dead replica cannot fail or stall a fleet-wide call.
        ``handle``: the actor to ask (default: the record's now)."""
        actor = record.handle if handle is None else handle
        try:
            return await asyncio.wait_for(awaited(getattr(actor, method).remote(*args, **kwargs)), timeout_s)
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
        handles = [r.handle for r in records]  # the actors asked: a restart meanwhile is another one
        tasks = [
            asyncio.ensure_future(self._call(r, method, *args, timeout_s=timeout_s, handle=h, **kwargs))
            for r, h in zip(records, handles)
        ]
        results: list[Any] = [None] * len(tasks)
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

    def _fail(self, record: ReplicaRecord, detail: str) -> None:
        self._set_state(record, HealthState.DEAD, detail)
        self._schedule_restart(record)


__all__ = ["ControlFanOut"]
