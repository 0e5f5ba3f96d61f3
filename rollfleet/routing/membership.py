"""The replicas a :class:`~rollfleet.routing.balancer.GlobalRequestLoadBalancer` routes to: who
they are (verl's membership API, restarts under the same id), whether each may be routed to, and
what each one's own load reports say.

Kept apart from the routing decision itself (:mod:`rollfleet.routing.balancer`) because these
rules are about whose count a number is: a replica removed, re-added or restarted keeps this
client's requests on the incarnation they went to (:class:`~rollfleet.routing.server_state.Departed`),
and a report is combined with this client's live counts, never a dead process's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from rollfleet.routing.policies import ReplicaView, RoutingPolicy
from rollfleet.routing.server_state import Departed, ServerState, same_handle
from rollfleet.types import LoadReport


class ReplicaMembership:
    """Membership, health and load reports of the balancer (its base class). Needs from it:
    ``_servers``, ``_departed``, ``_views``, ``_policy``, ``_preferred``, ``on_room``, ``client_id``
    and ``_placeable``."""

    _servers: dict[str, ServerState]
    _departed: Departed
    _views: Optional[list[ReplicaView]]
    _policy: RoutingPolicy
    _preferred: Optional[frozenset[str]]
    on_room: Optional[Callable[[bool], None]]
    client_id: str

    if TYPE_CHECKING:

        def _placeable(self) -> tuple[list[ReplicaView], bool]: ...

    def report_load(self, report: LoadReport, handle: Any = None) -> None:
        """Fold in a replica's own report (piggybacked on a response, or polled). ``handle``: the
        one the response came from; a report of a replica restarted since (another handle now) is
        the dead process's, not the new one's load, and its clock is not the new one's either."""
        state = self._servers.get(report.replica_id)
        if state is None or report.timestamp < state.reported_at:
            return
        if handle is not None and not same_handle(state.handle, handle):
            return
        state.reported_at = report.timestamp
        others_before = state.others
        mine = report.by_client.get(self.client_id, (0, 0)) if report.by_client is not None else None
        if mine is not None:  # exact: our share as the replica counted it
            state.others = max(0, report.inflight - mine[0])
            state.others_tokens = max(0, report.inflight_tokens - mine[1])
        else:  # a replica that does not split its counts: our share now is the best guess
            state.others = max(0, report.inflight - state.local)
            state.others_tokens = max(0, report.inflight_tokens - state.local_tokens)
        state.kv_usage = report.kv_usage
        state.sync()
        state.waiting = report.waiting
        if state.others < others_before and self.on_room is not None:
            self.on_room(True)  # other clients' requests finished there: room for any number

    def set_routable(self, server_id: str, routable: bool) -> None:
        """Include or exclude a replica (dead, suspect, restarting, on stale weights)."""
        state = self._servers.get(server_id)
        if state is not None:
            if state.routable != routable:
                self._views = None
            state.routable = routable
            if self.on_room is not None and (routable or not self._placeable()[0]):
                # room, or none anywhere: held requests then fail over to the retry policy's wait
                # for a routable replica (bounded by retry.no_server_wait_s), not hang on this one
                self.on_room(True)

    def set_preferred(self, server_ids: Optional[Iterable[str]]) -> None:
        """Replicas that new assignments go to while any of them is routable (None: no preference).
        A rolling weight update sets the replicas already on the new version: new trajectories
        start there, sticky sessions stay where their prefix cache is. A set that changes may
        give held requests room (those held only because the preferred replicas were full)."""
        preferred = frozenset(server_ids) if server_ids is not None else None
        if preferred != self._preferred:
            self._preferred = preferred
            if self.on_room is not None:
                self.on_room(True)

    def is_routable(self, server_id: str) -> bool:
        state = self._servers.get(server_id)
        return state is not None and state.routable

    def set_handle(self, server_id: str, handle: Any) -> None:
        """A restarted replica keeps its id but has a new handle."""
        state = self._servers.get(server_id)
        if state is not None:
            state.handle = handle
            state.reported_at = float("-inf")  # a new process: its clock starts afresh
            state.version = None  # and its weights are the ones it loads, which its snapshot says
            # none of the dead process's load (others', its queue, KV) runs on the new one
            state.others = state.others_tokens = state.waiting = 0
            state.kv_usage = 0.0
            state.sync()

    def add_servers(self, servers: dict[str, Any]) -> None:
        """Add (or re-add) replicas. Requests sent to a replica before it was removed stay counted
        apart (``_departed``): their release never uncounts the new one's; re-added as the very
        same actor, they are its load again; a replica present already keeps its count (the same
        actor) or is a restart (another)."""
        for server_id, handle in servers.items():
            present = self._servers.get(server_id)
            if present is not None:  # its count stays (it was overwritten: releases went negative)
                if not same_handle(present.handle, handle):
                    self.set_handle(server_id, handle)
                continue
            state = self._servers[server_id] = ServerState(server_id, handle)
            earlier = self._departed.take_back(server_id, handle)
            if earlier is not None:
                state.local, state.local_tokens = earlier.local, earlier.local_tokens
                state.sync()
        self._views = None
        self._policy.on_servers_changed(list(self._servers))
        if servers and self.on_room is not None:
            self.on_room(True)

    def remove_servers(self, server_ids: Iterable[str]) -> None:
        """Remove replicas; their sticky sessions are invalidated (lazily, on the next acquire)."""
        removed = []
        for server_id in server_ids:
            state = self._servers.pop(server_id, None)
            if state is not None:
                removed.append(server_id)
                self._departed.add(server_id, state)
        self._views = None
        self._policy.on_servers_changed(list(self._servers))
        if removed and self.on_room is not None:
            self.on_room(True)  # held requests re-place (or, with no replica left, fail over)

    def get_inflight_count(self, server_id: str) -> int:
        state = self._servers.get(server_id)
        return state.local if state is not None else 0

    def get_all_servers(self) -> dict[str, Any]:
        return {sid: s.handle for sid, s in self._servers.items()}

    def get_total_inflight(self) -> int:
        return sum(s.local for s in self._servers.values())

    def _loads(self) -> dict[str, int]:
        return {sid: s.local for sid, s in self._servers.items()}


__all__ = ["ReplicaMembership"]
