"""Health supervision of the fleet's replicas (a base of :class:`FleetController`).

Every ``probe_interval_s`` each replica's ``load()`` is called with a timeout. A failed probe makes
a healthy replica ``suspect``; ``failures_to_dead`` in a row make it ``dead``, and so does Ray
saying the actor died (its process or node is gone: no point asking twice). When every replica
times out in the same rounds, the controller or the host is stalled rather than each replica hung
(a CPU host whose engines starve everything else): a replica then dies only once it has been
silent for ``health.busy_grace_s``, so one stall cannot kill the whole fleet at once. Each round also asks
Ray which nodes live: the replicas of a dead node are dead at once, not after three probes (a node
table that does not answer within ``health.probe_timeout_s`` is skipped, the replicas still probed).

A dead replica is restarted (new actor, same id) and stays ``syncing`` until it has the current
weights. When its node died and no other node has room, it waits as ``pending`` (visible in
``status()``) and tries again every ``placement.pending_retry_s``, so a node that joins is used.
A start that fails is tried again with backoff (``pending``, with the error), forever unless
``health.max_restart_attempts`` says otherwise: capacity is never lost without a word.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

from rollfleet.errors import InsufficientResources
from rollfleet.health import HealthState, ReplicaRecord, can_transition
from rollfleet.manager.fanout import ControlTimeout
from rollfleet.records import FleetEvent
from rollfleet.types import LoadReport

if TYPE_CHECKING:
    from rollfleet.config import RolloutConfig
    from rollfleet.manager.placement import Placer
    from rollfleet.records import ReplicaInfo

logger = logging.getLogger(__name__)

#: Grace given to a replica declared dead to stop its engine before its actor is killed.
STOP_TIMEOUT_DEAD_S = 10.0
#: A new client's first snapshot asks afresh for loads older than this (s): clients that start
#: one right after another share answers (see :meth:`HealthSupervisor.fresh_loads`).
FIRST_VIEW_LOAD_AGE_S = 0.01
#: ... and waits this long at most (s) for them; what comes later reaches it with its next refresh.
FIRST_VIEW_WAIT_S = 0.5


class HealthSupervisor:
    """Probes, declares dead, restarts. Needs from its subclass: ``config``, ``_records``,
    ``_placer``, ``_restart_tasks``, ``_events``, ``_notify``, ``_start_replica``, ``_stop_handle``."""

    # What the subclass provides, declared for the type checker (set in its ``__init__``).
    config: RolloutConfig
    _records: dict[str, ReplicaRecord]
    _placer: Optional[Placer]
    _restart_tasks: dict[str, asyncio.Task[None]]
    _events: list[FleetEvent]
    _probe_task: Optional[asyncio.Task[None]]
    _closed: bool
    _learner_host: Optional[str]  # its placement group also holds a colocated learner: never released here

    if TYPE_CHECKING:

        def _notify(self) -> None: ...

        async def _start_replica(self, rid: str) -> ReplicaInfo: ...

        async def _stop_handle(self, handle: Any, timeout_s: float = 30.0) -> None: ...

    def _ensure_prober(self) -> None:
        if self._closed:
            return
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
        await self._check_nodes()
        records = [
            r for r in self._records.values() if r.state in (HealthState.HEALTHY, HealthState.SUSPECT) and not r.probing
        ]
        outcomes = await asyncio.gather(*(self._ask(r) for r in records))
        # Every replica timing out in the same round points at this controller or the whole host
        # stalling (CPU-bound engines starving every process), not at all of them hanging at once.
        stalled = len(outcomes) >= 2 and all(isinstance(o[1], asyncio.TimeoutError) for o in outcomes)
        for record, (handle, outcome) in zip(records, outcomes):
            self._judge(record, handle, outcome, fleet_stalled=stalled)
        self._notify()  # a safety net: whatever changed without a notification shows now

    #: The load probe a new client's first snapshot waits on, shared by every client that starts
    #: meanwhile (see :meth:`fresh_loads`).
    _load_query: Optional[asyncio.Future[None]] = None
    _loads_asked_at = float("-inf")  # when it was sent (monotonic)

    async def fresh_loads(self) -> None:
        """Ask every healthy replica for its load now, and wait for the answers (at most
        :data:`FIRST_VIEW_WAIT_S`), unless a round or such a query asked less than
        :data:`FIRST_VIEW_LOAD_AGE_S` ago.

        For a client's first snapshot. A client takes what a replica reports beyond its own
        requests as other clients' load until its next refresh; the load the rounds left behind is
        up to ``health.probe_interval_s`` old, and right after another client's burst it still
        counts that burst's finished requests. A new client used to send its first requests away
        from those replicas for a whole refresh (and split GRPO groups over replicas on the way).
        One query at a time, however many clients start: they wait on the same answers. Only
        answers count here; a replica that fails to answer is judged by the rounds, which this
        query never holds off (it is not the one probe in flight that makes a round skip one).
        """
        query = self._load_query
        now = time.monotonic()
        if query is None or (query.done() and now - self._loads_asked_at >= FIRST_VIEW_LOAD_AGE_S):
            stale = now - FIRST_VIEW_LOAD_AGE_S
            records = [r for r in self._records.values() if r.state == HealthState.HEALTHY and r.answered_at < stale]
            if not records:
                return
            query = self._load_query = asyncio.ensure_future(self._take_loads(records))
            self._loads_asked_at = now
        limit = min(FIRST_VIEW_WAIT_S, self.config.health.probe_timeout_s)
        try:
            await asyncio.wait_for(asyncio.shield(query), limit)
        except asyncio.TimeoutError:
            pass  # the first view keeps the rounds' loads for the replicas that are slow to say

    async def _take_loads(self, records: list[ReplicaRecord]) -> None:
        """Each answer as it comes (a slow replica must not hold the others' back past the wait),
        as a load only: health is the rounds' to judge (an answer asked for before a round's
        probe failed must not make the replica healthy again, nor count as heard from since)."""

        async def take(record: ReplicaRecord) -> None:
            handle, outcome = await self._ask(record, probe=False)
            if isinstance(outcome, BaseException):
                return
            if record.handle is handle and record.state in (HealthState.HEALTHY, HealthState.SUSPECT):
                record.load = newer_load(record.load, outcome)

        await asyncio.gather(*(take(r) for r in records))

    #: The query of Ray's node table in flight, shared by whoever asks meanwhile (see :meth:`_dead_nodes`).
    _node_query: Optional[asyncio.Future[set[str]]] = None

    async def _dead_nodes(self) -> set[str]:
        """The nodes holding this fleet's replicas that Ray reports dead, or none when Ray does not
        answer within ``health.probe_timeout_s``: a stalled GCS must not stall the probe rounds
        (the replicas are still asked, and a dead one still found out). One query at a time: a
        query that hangs is waited on again by the next round, not joined by one thread more."""
        if self._placer is None:
            return set()
        query = self._node_query
        if query is None or query.done():
            query = self._node_query = asyncio.ensure_future(self._placer.dead_nodes())
            query.add_done_callback(_log_failed_query)
        limit = self.config.health.probe_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(query), limit)
        except asyncio.TimeoutError:
            logger.warning("Ray did not list the cluster's nodes within health.probe_timeout_s=%gs", limit)
        except Exception:
            pass  # logged once, by _log_failed_query
        return set()

    async def _check_nodes(self) -> None:
        """A dead node takes its replicas with it: dead at once, restarted where there is room."""
        if self._placer is None:
            return
        dead = await self._dead_nodes()
        for record in list(self._records.values()):
            # Only serving replicas: one still starting fails its start call and is re-placed there.
            if record.node_id in dead and record.state in (HealthState.HEALTHY, HealthState.SUSPECT):
                self._set_state(record, HealthState.DEAD, f"node {record.node_id[:12]} died", force=True)
                self._schedule_restart(record)

    async def _ask(self, record: ReplicaRecord, probe: bool = True) -> tuple[Any, Any]:
        """``(handle, load report or the exception)``; one probe in flight per replica, so failures
        reported by many clients at once cannot count one stall several times. ``probe`` False: a
        first view's query (:meth:`fresh_loads`), not that probe: a round that comes meanwhile asks
        too, and judges what it gets (a hung replica would otherwise dodge the rounds while
        clients keep starting)."""
        handle = record.handle
        if probe:
            record.probing = True
        try:
            return handle, await asyncio.wait_for(handle.load.remote(), self.config.health.probe_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return handle, exc
        finally:
            if probe:
                record.probing = False

    def _judge(self, record: ReplicaRecord, handle: Any, outcome: Any, *, fleet_stalled: bool = False) -> None:
        """Act on one probe's answer: ``failures_to_dead`` failures in a row make the replica dead
        (Ray saying the actor died, at once). In rounds where every replica timed out, a timeout
        kills only after ``health.busy_grace_s`` without any answer."""
        if record.handle is not handle or record.state not in (HealthState.HEALTHY, HealthState.SUSPECT):
            return  # restarted or declared dead meanwhile: this answer is about an old actor
        if not isinstance(outcome, BaseException):
            record.load = newer_load(record.load, outcome)  # a first view's may be newer (fresh_loads)
            record.consecutive_failures = 0
            record.answered_at = time.monotonic()
            if record.state == HealthState.SUSPECT:
                self._set_state(record, HealthState.HEALTHY, "probe ok")
            return
        health = self.config.health
        record.consecutive_failures += 1
        detail = f"probe failed ({record.consecutive_failures}x): {type(outcome).__name__}"
        died = _actor_died(outcome)
        dead = died or record.consecutive_failures >= health.failures_to_dead
        if dead and fleet_stalled and not died:
            silent = time.monotonic() - record.answered_at
            dead = silent > health.busy_grace_s
            detail += f" with every replica at once, {silent:.0f}s silent (dead after health.busy_grace_s)"
        if dead:
            self._set_state(record, HealthState.DEAD, detail)
            self._schedule_restart(record)
        else:
            self._set_state(record, HealthState.SUSPECT, detail)

    async def report_failure(self, replica_id: str, reason: str = "") -> None:
        """A client saw a call fail: probe that replica now instead of at the next round. Only a
        definite answer acts before the round (a dead actor, an unhealthy engine): a timeout here
        is judged by the rounds, which can tell one replica's silence from a stalled host."""
        record = self._records.get(replica_id)
        if record is None or record.probing or record.state not in (HealthState.HEALTHY, HealthState.SUSPECT):
            return
        handle, outcome = await self._ask(record)
        if isinstance(outcome, asyncio.TimeoutError):
            return
        self._judge(record, handle, outcome)

    async def _start_in_time(self, rid: str) -> ReplicaInfo:
        """:meth:`_start_replica` within ``health.start_timeout_s`` (a restart, and each replica
        ``add_replicas`` starts): one that hangs while it starts or loads weights fails in time."""
        limit = self.config.health.start_timeout_s
        try:
            return await asyncio.wait_for(self._start_replica(rid), limit)
        except ControlTimeout:
            raise  # a call of the start-up ran out of its own, shorter, limit: its error says which
        except asyncio.TimeoutError:
            raise TimeoutError(f"{rid}: start took over health.start_timeout_s={limit:g}s") from None

    def _schedule_restart(self, record: ReplicaRecord) -> None:
        rid = record.replica_id
        running = self._restart_tasks.get(rid)
        # A restart that has brought it back but not yet left the table (its task ends a loop
        # iteration or two later) is no restart in progress: it died again, it is restarted again.
        if not self.config.health.auto_restart or (running is not None and not running.done()) or self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._restart(rid))
        self._restart_tasks[rid] = task

        def forget(done: "asyncio.Task[None]") -> None:
            if self._restart_tasks.get(rid) is done:  # not a newer restart's entry
                del self._restart_tasks[rid]

        task.add_done_callback(forget)

    async def _restart(self, rid: str) -> None:
        """Bring ``rid`` back: a new actor on the current weights. A failed try is retried with
        backoff (``health.restart_backoff_s``, doubling up to ``max_restart_backoff_s``) until
        ``max_restart_attempts``; meanwhile the replica shows ``pending`` with the reason."""
        record = self._records.get(rid)
        if record is None:
            return
        health = self.config.health
        # Ask the old replica to stop its engine first: killing the actor outright would orphan
        # an engine subprocess (vLLM's process group) that still holds memory and cores.
        await self._stop_handle(record.handle, timeout_s=STOP_TIMEOUT_DEAD_S)
        record.restarts += 1
        self._set_state(record, HealthState.RESTARTING, f"restart #{record.restarts}")
        if not await self._after_a_quick_death(record):
            return
        lost_placements = 0
        tries = 0
        while self._restart_wanted(record):
            try:
                await self._start_in_time(rid)
                record.restarted_at = asyncio.get_running_loop().time()
                return
            except InsufficientResources as exc:  # no room now: wait, visibly, and try again
                if not self._restart_wanted(record):
                    return
                self._set_state(record, HealthState.PENDING, f"waiting for devices: {exc}", force=True)
                await asyncio.sleep(self.config.placement.pending_retry_s)
                continue
            except Exception as exc:
                await self._stop_handle(record.handle, timeout_s=STOP_TIMEOUT_DEAD_S)
                if not self._restart_wanted(record):
                    return
                if record.node_id in await self._dead_nodes() and lost_placements < 3:
                    lost_placements += 1  # its node died while it started: place it again
                    continue
                tries += 1
                if health.max_restart_attempts is not None and tries >= health.max_restart_attempts:
                    self._give_up(record, f"gave up after {tries} restart tries: {exc!r}")
                    return
                delay = self._restart_backoff_s(tries)
                logger.warning("replica %s: restart try %d failed (%r); next try in %.1fs", rid, tries, exc, delay)
                self._set_state(
                    record,
                    HealthState.PENDING,
                    f"restart try {tries} failed: {exc!r}; next try in {delay:.1f}s",
                    force=True,
                )
                await asyncio.sleep(delay)

    async def _after_a_quick_death(self, record: ReplicaRecord) -> bool:
        """Back off before restarting a replica that died soon after its last restart (out of
        memory on its first batch, a bad checkpoint): such restarts went on at once, for ever. The
        waits double as a failed start's, and ``max_restart_attempts`` in a row give it up.
        Returns whether to go on."""
        health = self.config.health
        now = asyncio.get_running_loop().time()
        lived = None if record.restarted_at is None else now - record.restarted_at
        if lived is None or lived >= health.max_restart_backoff_s:
            record.quick_deaths = 0
            return True
        if record.node_id and record.node_id in await self._dead_nodes():
            return True  # its node died, not it: placed elsewhere at once (its count stays)
        record.quick_deaths += 1
        if health.max_restart_attempts is not None and record.quick_deaths >= health.max_restart_attempts:
            self._give_up(record, f"gave up: died within {lived:.1f}s of {record.quick_deaths} restarts in a row")
            return False
        delay = self._restart_backoff_s(record.quick_deaths)
        logger.warning("replica %s died %.1fs after its restart; next start in %.1fs", record.replica_id, lived, delay)
        self._set_state(
            record,
            HealthState.RESTARTING,  # not pending: it waits for no devices
            f"died {lived:.1f}s after restart #{record.restarts - 1} ({record.quick_deaths} in a row); "
            f"next start in {delay:.1f}s",
            force=True,
        )
        await asyncio.sleep(delay)
        return self._restart_wanted(record)

    def _restart_backoff_s(self, failures: int) -> float:
        """The wait after ``failures`` in a row (failed starts, or quick deaths), doubling to its cap."""
        health = self.config.health
        return min(health.max_restart_backoff_s, health.restart_backoff_s * 2 ** (failures - 1))

    def _give_up(self, record: ReplicaRecord, why: str) -> None:
        """Leave ``record`` dead for good, saying why; its devices go back to the cluster."""
        rid = record.replica_id
        logger.error("replica %s: %s", rid, why)
        self._set_state(record, HealthState.DEAD, why, force=True)
        if self._placer is not None and rid != self._learner_host:
            self._placer.release(rid)  # nothing revisits it: its devices go back to the cluster
            record.placement, record.devices, record.released = None, None, True

    def _restart_wanted(self, record: ReplicaRecord) -> bool:
        """Whether ``record``'s restart goes on: still a member, not being removed, the fleet not
        shut down. Checked besides cancellation, which Python 3.11's ``wait_for`` (in the calls a
        start makes) swallows when it comes just as the awaited call ends: the restart then went on
        trying, a removal or a shutdown waiting on it for good."""
        return (
            not self._closed and self._records.get(record.replica_id) is record and record.state != HealthState.DRAINING
        )

    def _set_state(self, record: ReplicaRecord, state: HealthState, detail: str, force: bool = False) -> None:
        if not force and not can_transition(record.state, state):
            logger.warning("replica %s: ignoring transition %s -> %s", record.replica_id, record.state, state)
            return
        if record.state != state:
            self._events.append(
                FleetEvent(
                    t=time.time(), replica_id=record.replica_id, from_state=record.state, to=state, detail=detail
                )
            )
            del self._events[:-500]
        record.state = state
        record.detail = detail
        self._notify()

    async def inject_fault(self, replica_id: str, kind: str, factor: float = 10.0) -> None:
        await self._records[replica_id].handle.inject_fault.remote(kind, factor)


def _log_failed_query(query: "asyncio.Future[set[str]]") -> None:
    if not query.cancelled() and query.exception() is not None:
        logger.warning("listing the cluster's nodes failed: %r", query.exception())


def newer_load(current: Optional[LoadReport], report: LoadReport) -> LoadReport:
    """The newer of two load reports of one replica process (one clock): answers to two probes
    in flight at once may come back in either order."""
    return report if current is None or report.timestamp >= current.timestamp else current


def _actor_died(exc: BaseException) -> bool:
    """Ray says the actor is gone for good (its process or node died): no point probing again."""
    try:
        from ray.exceptions import ActorDiedError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, ActorDiedError)


__all__ = ["HealthSupervisor", "STOP_TIMEOUT_DEAD_S"]
