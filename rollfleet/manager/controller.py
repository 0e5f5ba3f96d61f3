"""The fleet controller: the control plane of the fleet, as one asyncio Ray actor.

It launches, probes, restarts and removes replicas, fans control ops (pause, weight updates,
sleep, profile) out to every replica, and publishes :class:`FleetSnapshot` records that clients
poll. It is never on the data plane: generation goes client -> replica directly, so a slow
controller can delay a client's view of the fleet but never a request.

Placement: each replica is a placement group on one node (:mod:`rollfleet.manager.placement`),
kept across restarts while the node lives. Health and restarts live in
:mod:`rollfleet.manager.supervision`, a replica's start-up in :mod:`rollfleet.manager.joining`,
the control fan-out in :mod:`rollfleet.manager.fanout`, weight updates in
:mod:`rollfleet.manager.weight_updates`, the snapshots clients route by in
:mod:`rollfleet.manager.publishing`; this module holds membership. On every
membership change the Prometheus scrape config follows (``rollout.prometheus``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Callable, Optional

from rollfleet.config import RolloutConfig
from rollfleet.errors import FleetShutDown, InsufficientResources, InvalidRequest
from rollfleet.health import HealthState, ReplicaRecord
from rollfleet.manager.joining import ReplicaStarter, replica_info
from rollfleet.manager.placement import Placer, ReplicaPlacement, WorkerPlacement
from rollfleet.manager.prometheus import ScrapeConfigWriter
from rollfleet.manager.publishing import SnapshotPublisher
from rollfleet.manager.supervision import STOP_TIMEOUT_DEAD_S, HealthSupervisor
from rollfleet.manager.weight_updates import WeightUpdates
from rollfleet.records import FleetEvent, FleetStatus, ReplicaInfo, ReplicaStatus
from rollfleet.utils.aio import run_to_end
from rollfleet.utils.ids import unique_hex

logger = logging.getLogger(__name__)

#: Builds a replica handle: (replica_id, replica_index) -> handle. A custom factory places its
#: replicas itself (tests run them in-process); the default one places each in a placement group.
ReplicaFactory = Callable[[str, int], Any]


class FleetController(SnapshotPublisher, HealthSupervisor, ReplicaStarter, WeightUpdates):
    def __init__(self, config: RolloutConfig, replica_factory: Optional[ReplicaFactory] = None) -> None:
        self.config = config
        self._factory = replica_factory
        self._placer = (
            Placer(config.placement, config.tensor_parallel_size, config.name) if replica_factory is None else None
        )
        self._learner_group: Optional[WorkerPlacement] = None  # the learner's own device (separate mode)
        self._learner_lock = asyncio.Lock()
        self._scrape = ScrapeConfigWriter(config.prometheus, config.name)
        self._background: set[asyncio.Task[Any]] = set()
        self._records: dict[str, ReplicaRecord] = {}
        self._indices: dict[str, int] = {}
        self._next_index = 0
        self._membership_epoch = 0
        self.current_version: Optional[int] = None
        self._weights: Any = None  # the last weights pushed (an ObjectRef when called through Ray)
        self._has_weights = False  # False: the engines' boot weights are the current version
        self._checksum: Optional[str] = None  # the committed weights' digest (None: engines cannot tell)
        self._published_unverified = False  # published with no replica live: the first one back gives the digest
        self._rolling_version: Optional[int] = None  # the version a rolling update is committing
        self._probe_task: Optional[asyncio.Task[None]] = None
        self._restart_tasks: dict[str, asyncio.Task[None]] = {}
        self._starting: set[asyncio.Task[Any]] = set()  # add_replicas' starts, which shutdown stops
        self._adding: set[str] = set()  # the replicas add_replicas is starting (no record before placed)
        self._closed = False
        self._learner_host: Optional[str] = None  # the replica whose devices a colocated learner shares
        self._events: list[FleetEvent] = []
        self._update_lock = asyncio.Lock()  # one weight update at a time; a joining replica's last load
        self._changed: Optional[asyncio.Event] = None  # set (and replaced) on every change
        self._changes = (unique_hex(), 0)  # (this controller, changes so far): orders its snapshots

    # ------------------------------------------------------------------ membership
    async def launch(self, num_replicas: int, initial_version: int = 0) -> list[ReplicaInfo]:
        """Start ``num_replicas`` replicas serving the engine's boot weights as ``initial_version``."""
        if self.current_version is None:
            self.current_version = initial_version
        infos = await self.add_replicas(num_replicas, field_name="rollout.num_replicas")
        self._ensure_prober()
        return infos

    async def add_replicas(self, n: int, field_name: str = "add_replicas(n)") -> list[ReplicaInfo]:
        """Start ``n`` more replicas; each serves only once it has the current weights.

        Asking for more devices than the cluster has fails at once with
        :class:`InsufficientResources` naming ``field_name``; nothing is started then. A caller that
        gives up does not stop the starts: they run to their end (bounded by
        ``health.start_timeout_s``), rather than leave replicas syncing for good, their actors up.
        """
        self._check_open()
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:  # -1 reused the last replica's id
            raise InvalidRequest(field_name, "an integer >= 0", n)
        if self.current_version is None:  # a replica was marked healthy while syncing for good
            raise InvalidRequest(field_name, "replicas added after launch() (it sets the boot weights' version)", n)
        return await run_to_end(
            self._add(n, field_name), "adding replicas", lambda infos: f"started {[i.replica_id for i in infos]}"
        )

    async def _add(self, n: int, field_name: str) -> list[ReplicaInfo]:
        indices = range(self._next_index, self._next_index + n)
        self._next_index += n
        ids = [f"replica-{i}" for i in indices]
        # Counted from here on, so that a call made while these start sees them holding devices
        # (they have no record until placed): two calls could each pass the check on their own.
        self._adding.update(ids)
        try:
            if self._placer is not None:
                # A replica given up on gave its devices back: the new ones may have them.
                holding = {rid for rid, r in self._records.items() if not r.released} | self._adding
                grows = len(holding) > n  # beside replicas already holding devices: say how many are new
                await self._placer.check_capacity(len(holding), field_name, adding=n if grows else None)
            self._check_open()
            self._indices.update(zip(ids, indices))
            starts = [asyncio.ensure_future(self._start_in_time(rid)) for rid in ids]
            self._starting.update(starts)
            for start in starts:
                start.add_done_callback(self._starting.discard)
            results = await asyncio.gather(*starts, return_exceptions=True)
        finally:
            self._adding.difference_update(ids)
        failed = [(rid, r) for rid, r in zip(ids, results) if isinstance(r, BaseException)]
        if failed and self._closed:  # cancelled by shutdown(), which stops them and waits for that
            raise FleetShutDown("add_replicas")
        for rid, _ in failed:  # the others serve; these leave nothing behind
            record = self._records.pop(rid, None)
            if record is not None:
                await self._stop_handle(record.handle, timeout_s=STOP_TIMEOUT_DEAD_S)
            if self._placer is not None:
                self._placer.release(rid)
        if failed:
            self._membership_changed()
            serving = [rid for rid, r in zip(ids, results) if not isinstance(r, BaseException)]
            logger.warning("add_replicas: %d of %d failed to start; serving: %s", len(failed), n, serving or "none")
            raise failed[0][1]
        self._ensure_prober()
        return [r for r in results if not isinstance(r, BaseException)]  # all of them: none failed

    def _spawn(self, rid: str, placement: Optional[ReplicaPlacement]) -> Any:
        if self._factory is not None:
            return self._factory(rid, self._indices[rid])
        from rollfleet.server.actor import ReplicaActor

        options = placement.rank(0).actor_options() if placement is not None else {"num_cpus": 0}
        # mypy keeps a Ray-decorated class's own type: it does not know ActorClass.options
        return ReplicaActor.options(name=None, **options).remote(rid, self.config, self._indices[rid])  # type: ignore[attr-defined]

    async def remove_replicas(self, replica_ids: list[str], drain_timeout_s: float = 30.0) -> list[str]:
        """Stop routing to the replicas, let their in-flight work finish (bounded), then stop them.

        A restart under way is stopped first, so the actor it may have spawned is the one the
        drain stops (left running, it held its devices with nobody to stop it). A caller that
        gives up does not stop the removal: it runs to its end (bounded by ``drain_timeout_s``
        and the stop), rather than leaving the replicas draining, unroutable, for good.

        Arguments are checked before any replica is touched: a bad ``drain_timeout_s`` found
        after the replicas were marked draining left them so, holding their devices."""
        if isinstance(replica_ids, str) or not all(isinstance(rid, str) for rid in replica_ids):
            raise InvalidRequest("replica_ids", "a list of replica ids (strings)", replica_ids)
        if (
            isinstance(drain_timeout_s, bool)
            or not isinstance(drain_timeout_s, (int, float))
            or not (0 <= drain_timeout_s < math.inf)
        ):
            raise InvalidRequest("drain_timeout_s", "a finite number of seconds >= 0", drain_timeout_s)
        return await run_to_end(
            self._remove(replica_ids, drain_timeout_s), "a replica removal", lambda r: f"removed {r}"
        )

    async def _remove(self, replica_ids: list[str], drain_timeout_s: float) -> list[str]:
        if self._learner_host in replica_ids and self._learner_host in self._records:
            raise InvalidRequest(
                "replica_ids",
                f"not {self._learner_host}: the colocated learner (placement.colocate) shares its devices, and "
                "removing its placement group would kill the learner",
                replica_ids,
            )
        removed, restarts = [], []
        for rid in replica_ids:
            record = self._records.get(rid)
            if record is None:
                continue
            self._set_state(record, HealthState.DRAINING, "removal requested", force=True)
            removed.append(rid)
            restart = self._restart_tasks.pop(rid, None)
            if restart is not None:
                restart.cancel()
                restarts.append(restart)
        self._membership_changed()
        if restarts:
            await asyncio.wait(restarts, timeout=STOP_TIMEOUT_DEAD_S)
        await asyncio.gather(*(self._drain_and_stop(rid, drain_timeout_s) for rid in removed))
        for rid in removed:
            self._records.pop(rid, None)
            if self._placer is not None:
                self._placer.release(rid)
        self._membership_changed()
        return removed

    async def _drain_and_stop(self, rid: str, timeout_s: float) -> None:
        record = self._records.get(rid)
        if record is None:  # removed meanwhile (another removal, a shutdown): stopped there
            return
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

    def _membership_changed(self) -> None:
        """A replica was added, removed or got a new actor: clients must fetch handles again, and
        Prometheus must scrape the new addresses."""
        self._membership_epoch += 1
        self._notify()
        if self.config.prometheus.enable:
            addresses = [r.address for r in self._records.values() if r.address]
            self._run_in_background(self._scrape.refresh(addresses))

    def _run_in_background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def get_replicas(self) -> list[ReplicaInfo]:
        return [replica_info(r) for r in self._records.values()]

    async def replica_placements(self) -> dict[str, Optional[ReplicaPlacement]]:
        """Each replica's placement group and node (for tools and tests that ask Ray about it)."""
        return {rid: r.placement for rid, r in self._records.items()}

    async def learner_placement(self) -> Optional[WorkerPlacement]:
        """Where the learner goes: a share of the first replica's first bundle when colocated
        (``placement.colocate``), else a device bundle of its own, reserved once (a learner made
        again, after a failure, goes where the first was; each call used to reserve one more
        device, held until shutdown); None when nothing is placed."""
        if self._placer is None or await self._placer.device() == "none":
            return None
        if self.config.placement.colocate:
            placed = sorted(self._placer.placements.items(), key=lambda kv: self._indices.get(kv[0], 0))
            if not placed:
                raise InsufficientResources(
                    "placement.colocate", "a replica to share devices with", "no replica placed"
                )
            self._learner_host = placed[0][0]
            return placed[0][1].rank(0, fraction=self.config.placement.colocate_fraction)
        async with self._learner_lock:  # two callers at once get one device
            if self._learner_group is None:
                self._learner_group = await self._placer.reserve_worker("learner")
        return self._learner_group

    async def status(self) -> FleetStatus:
        return FleetStatus(
            current_version=self.current_version,
            membership_epoch=self._membership_epoch,
            replicas={
                r.replica_id: ReplicaStatus(
                    **replica_info(r).model_dump(),
                    consecutive_failures=r.consecutive_failures,
                    inflight=r.load.inflight if r.load else None,
                    kv_usage=r.load.kv_usage if r.load else None,
                    detail=r.detail,
                )
                for r in self._records.values()
            },
            events=self._events[-50:],
        )

    async def replica_stats(self) -> dict[str, Any]:
        async def one(r: ReplicaRecord) -> Any:
            try:
                return await asyncio.wait_for(r.handle.stats.remote(), self.config.health.probe_timeout_s)
            except Exception as exc:
                return {"error": repr(exc)}

        records = list(self._records.values())
        results = await asyncio.gather(*(one(r) for r in records))
        return {r.replica_id: s for r, s in zip(records, results)}

    def _check_open(self) -> None:
        if self._closed:
            raise FleetShutDown("add_replicas")

    async def shutdown(self) -> None:
        """Stop every replica, those still starting too: their starts and restarts are cancelled
        and waited for first, so that a placement group still being reserved is removed (left
        pending, it took the devices once they freed, and a replica came up after the shutdown)."""
        self._closed = True
        if self._probe_task is not None:
            self._probe_task.cancel()
        starts = [*self._restart_tasks.values(), *self._starting]
        for task in starts:
            task.cancel()
        if starts:  # each cleans up as it is cancelled; bounded, should one be stuck in a call that hangs
            await asyncio.wait(starts, timeout=STOP_TIMEOUT_DEAD_S)
        await asyncio.gather(*(self._stop_handle(r.handle) for r in self._records.values()), return_exceptions=True)
        self._records.clear()
        if self._placer is not None:
            self._placer.release_all()  # the learner's own bundle too: the placer reserved it
        self._learner_group = None
        self._membership_changed()


def _kill(handle: Any) -> None:
    """Kill a replica's actor (an in-process handle has none: nothing to do, and no Ray to start)."""
    try:
        import ray

        if isinstance(handle, ray.actor.ActorHandle):
            ray.kill(handle, no_restart=True)
    except Exception:
        pass


try:
    import ray

    @ray.remote(num_cpus=0, max_concurrency=10_000)  # type: ignore[call-overload]  # Ray's stub omits actor options
    class FleetControllerActor(FleetController):
        """Ray actor around :class:`FleetController` (asyncio; one per fleet)."""

except ImportError:  # pragma: no cover
    FleetControllerActor = None  # type: ignore[assignment,misc]


__all__ = ["FleetController", "FleetControllerActor", "ReplicaFactory"]
