"""A client's view of the fleet: membership, health, weight versions and loads.

It keeps the client's :class:`GlobalRequestLoadBalancer` up to date from the fleet controller's
snapshots, watched in the background (a long poll that returns on any change, or after
``load_refresh_interval_s`` with fresh loads; off the hot path: a request never waits for it).
Handles are re-sent only when membership changes. A replica that fails a call is quarantined
locally at once and reported to the controller, which probes it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from rollfleet.routing import FleetSnapshot, GlobalRequestLoadBalancer
from rollfleet.routing.server_state import same_handle
from rollfleet.utils import virtual_time

logger = logging.getLogger(__name__)


class FleetView:
    def __init__(
        self,
        balancer: GlobalRequestLoadBalancer,
        controller: Any = None,
        refresh_interval_s: float = 0.25,
        quarantine_s: float = 2.0,
    ) -> None:
        self.balancer = balancer
        self.controller = controller
        self.refresh_interval_s = refresh_interval_s
        self.quarantine_s = quarantine_s
        self._epoch = -1
        self._quarantined: dict[str, float] = {}
        self._routable: set[str] = set(balancer.get_all_servers())
        self._task: Optional[asyncio.Task[None]] = None
        self._first_refresh: Optional[asyncio.Task[None]] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.current_version: Optional[int] = None
        self.last_refresh = float("-inf")
        self._signature: Optional[tuple] = None
        self._inflight_refresh: Optional[asyncio.Future[None]] = None
        self._last: Optional[FleetSnapshot] = None

    async def ensure_started(self) -> None:
        """Start the refresher in the running loop (restart it if the loop changed).

        Called on every request, so it must be cheap and must start exactly one refresher even
        when many requests arrive at once: the task is created before the first await.
        """
        if self.controller is None:
            return
        loop = asyncio.get_running_loop()
        if self._task is None or self._loop is not loop or self._task.done():
            self._loop = loop
            self._first_refresh = loop.create_task(self.refresh())
            self._task = loop.create_task(self._refresh_forever(), name="rollfleet-fleet-view")
        if self._first_refresh is not None:
            if not self._first_refresh.done():
                try:
                    await asyncio.shield(self._first_refresh)
                except Exception as exc:  # not CancelledError: the caller's own cancellation goes on
                    # The controller may be restarting: route on the view as it is (a fleet with
                    # nothing routable is NoServerAvailable, which the retry policy waits out), as
                    # every later refresh that fails does, not with the controller's raw error.
                    logger.warning("fleet view: the first snapshot failed (%r); routing on the view as it is", exc)
            else:
                self._first_refresh = None

    async def _refresh_forever(self) -> None:
        """Watch the controller: a change (membership, health, versions) arrives at once, and a
        quiet fleet costs one call every ``refresh_interval_s`` (which brings fresh loads)."""
        watch = getattr(self.controller, "watch", None)
        while True:
            try:
                if watch is None:  # a controller without long polls: poll
                    await asyncio.sleep(self.refresh_interval_s)
                    await self.refresh()
                    continue
                snapshot = await watch.remote(
                    self._epoch, self._signature, self.refresh_interval_s, client_id=self.balancer.client_id
                )
                self.apply(snapshot)
                self.last_refresh = virtual_time.now()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the controller may be restarting; keep routing on the last view
                logger.debug("fleet view refresh failed: %r", exc)
                await asyncio.sleep(self.refresh_interval_s)

    async def refresh(self) -> None:
        """Fetch and apply a snapshot now. Concurrent callers share one fetch: when a whole fleet
        is unroutable, every waiting request asks for news, and they must not each cost the
        controller a call."""
        if self.controller is None:
            return
        inflight = self._inflight_refresh
        if inflight is None or inflight.done():
            inflight = self._inflight_refresh = asyncio.ensure_future(self._fetch_and_apply())
        await asyncio.shield(inflight)

    async def _fetch_and_apply(self) -> None:
        snapshot = await self.controller.snapshot.remote(self._epoch, client_id=self.balancer.client_id)
        self.apply(snapshot)
        self.last_refresh = virtual_time.now()

    async def refresh_if_older(self, max_age_s: float) -> None:
        """:meth:`refresh`, unless the view is younger than ``max_age_s``."""
        if virtual_time.now() - self.last_refresh >= max_age_s:
            await self.refresh()

    def apply(self, snapshot: FleetSnapshot) -> None:
        last = self._last
        if last is not None and snapshot.seq[0] == last.seq[0] and snapshot.seq[1] < last.seq[1]:
            return  # taken before the view's: applied, it would roll back versions and floors
        bal = self.balancer
        restarted: set[str] = set()
        if snapshot.handles is not None:
            known = bal.get_all_servers()
            gone = [sid for sid in known if sid not in snapshot.handles]
            if gone:
                bal.remove_servers(gone)
            for sid, handle in snapshot.handles.items():
                if sid not in known:
                    bal.add_servers({sid: handle})
                elif not same_handle(known[sid], handle):
                    bal.set_handle(sid, handle)  # restarted: a new actor behind the same id
                    self._quarantined.pop(sid, None)
                    restarted.add(sid)
            self._epoch = snapshot.membership_epoch
        previous = self._last.states if self._last is not None else {}
        self._last = snapshot
        self._drop_dead(snapshot, previous)
        if (
            self.current_version is not None
            and snapshot.current_version is not None
            and snapshot.current_version < self.current_version
        ):
            bal.forget_versions()  # rolled back: the versions it saw are no floor any more
        self.current_version = snapshot.current_version
        self._signature = snapshot.signature()
        now = virtual_time.now()
        self._routable = set(snapshot.routable_ids())
        for sid in bal.get_all_servers():
            until = self._quarantined.get(sid)
            if until is not None and until <= now:
                del self._quarantined[sid]
                until = None
            bal.set_routable(sid, sid in self._routable and until is None)
            bal.set_version(sid, snapshot.versions.get(sid))
        bal.set_preferred(snapshot.preferred_ids())
        for sid, report in snapshot.loads.items():
            if sid not in restarted:  # a load beside a new handle may be the dead actor's last
                bal.report_load(report)

    def expire_quarantine(self) -> None:
        """Let quarantined replicas back in once their time is up (cheap when none is)."""
        if not self._quarantined:
            return
        now = virtual_time.now()
        for sid, until in list(self._quarantined.items()):
            if until <= now:
                del self._quarantined[sid]
                self.balancer.set_routable(sid, self.controller is None or sid in self._routable)

    def _drop_dead(self, snapshot: FleetSnapshot, previous: dict[str, str]) -> None:
        """Requests in flight on a replica the controller just declared dead fail over now (its
        handle drops its connection) instead of waiting for a hung process to be killed."""
        servers = self.balancer.get_all_servers()
        serving = ("healthy", "suspect")
        for sid, state in snapshot.states.items():
            # dead, or already restarting (a quick controller may skip past "dead" between views)
            if previous.get(sid) in serving and state not in (*serving, "draining"):
                drop = getattr(servers.get(sid), "drop_connection", None)
                if drop is not None:
                    drop(f"{sid} declared dead by the fleet: {snapshot.details.get(sid, '')}")

    def describe(self) -> str:
        """Why replicas are (not) routable, as of the last snapshot: for errors and logs."""
        if self._last is None:
            return "no fleet snapshot yet" if self.controller is not None else "a fixed set of servers"
        quarantined = sorted(self._quarantined)
        extra = f"; quarantined here after a failed call: {', '.join(quarantined)}" if quarantined else ""
        return self._last.describe() + extra

    def quarantine(self, server_id: str, reason: str = "") -> None:
        """Stop routing to a replica that just failed a call, and tell the controller."""
        self._quarantined[server_id] = virtual_time.now() + self.quarantine_s
        self.balancer.set_routable(server_id, False)
        try:  # let it back in on time, not on the next acquire: requests held for room wait on it
            asyncio.get_running_loop().call_later(self.quarantine_s, self.expire_quarantine)
        except RuntimeError:  # no loop (a synchronous caller): the next acquire lets it back in
            pass
        if self.controller is not None:
            try:
                self.controller.report_failure.remote(server_id, reason)
            except Exception:  # the report is advisory; the controller probes on its own too
                pass

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None


__all__ = ["FleetView"]
