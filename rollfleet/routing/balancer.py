"""``GlobalRequestLoadBalancer``: verl's API, without verl's single-actor bottleneck.

verl runs one balancer as one synchronous Ray actor; every turn of every trajectory pays two round
trips to it (acquire, then a fire-and-forget release), which caps the whole fleet at roughly a
thousand routing decisions per second and lets counts drift. Here the same class is a plain,
in-process object: every client (one per agent-loop worker) holds its own, so a decision costs
microseconds and release is exact (it runs in the caller's ``finally``).

Where does global load come from, then? From the replicas: every response piggybacks the replica's
own in-flight counts, and the client's fleet view polls them. The balancer combines a report with
its own live counts (``others = reported - mine at report time``; ``estimate = others + mine now``),
so its picture of the fleet is exact for its own traffic and at most one refresh old for others'.
"Mine at report time" is the replica's own count of this balancer's requests (every request
carries :attr:`GlobalRequestLoadBalancer.client_id`; see :class:`~rollfleet.types.LoadReport`);
a report older than one already applied for the same replica is dropped.

Sticky sessions live here too (all turns of a trajectory run in one worker, so they stay local);
they give way only when the sticky replica is saturated (its engine queues requests, or its KV
cache is nearly full) *and* loaded past a configurable bound over the mean. A replica that runs
everything it has is not worth leaving: the moved turn re-prefills the whole conversation
elsewhere to save a slightly smaller batch, and the session stays moved. (Measured on 2 vLLM
replicas before this rule: the tail of each round, one replica finishing its share first, moved
4-13 of 32 sessions per round and left them split 20/12.) They end with
:meth:`finish_session`, and die with their replica. The verl-compatible methods keep their names
and return shapes; the class can still be wrapped as a Ray actor for code that expects a handle.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter
from typing import Any, Callable, Optional, Sequence, Union

from cachetools import LRUCache

from rollfleet.errors import NoServerAvailable
from rollfleet.routing.membership import ReplicaMembership
from rollfleet.routing.policies import ReplicaView, RoutingPolicy, get_policy
from rollfleet.routing.policies.prefix_affinity import prefix_key
from rollfleet.routing.server_state import Departed, ServerState
from rollfleet.routing.version_floor import VersionFloors, at_or_above
from rollfleet.types import TokenOutput

#: The sticky entry of a session whose replica failed it (:meth:`GlobalRequestLoadBalancer.unstick`):
#: its next turn is placed afresh, and is still a session's turn, never held back.
_REPLACE = ""


class GlobalRequestLoadBalancer(ReplicaMembership):
    """Routes request ids to replicas: sticky, load-aware, health-aware.

    Args:
        servers: ``{server_id: handle}``.
        max_cache_size: sticky sessions remembered (LRU); a finished session should call
            :meth:`finish_session` instead of relying on eviction.
        full_determinism: route by rendezvous hashing with no spill-over, so a request id lands on
            the same replica in every process and every run.
        policy: a policy name (see :mod:`rollfleet.routing.policies`) or instance. verl's default,
            ``least_inflight``, when not given.
        policy_options: keywords for the named policy's constructor (its config section).
        sticky_overload_factor, sticky_overload_slack: a sticky replica gives way when its
            in-flight count exceeds both ``factor * mean`` and ``mean + slack`` over routable ones,
        sticky_spill_kv_usage: ... and it is saturated: its engine reports waiting requests, or KV
            cache usage at or above this fraction.
        max_inflight_per_replica: :meth:`try_acquire_server` holds back a request that starts a
            new placement while every replica it may go to has this many requests in flight or
            more (late binding; see :mod:`rollfleet.client.dispatch`). None: never.
    """

    def __init__(
        self,
        servers: dict[str, Any],
        max_cache_size: int = 10000,
        full_determinism: bool = False,
        *,
        policy: Union[str, RoutingPolicy, None] = None,
        sticky: bool = True,
        sticky_overload_factor: float = 1.5,
        sticky_overload_slack: int = 8,
        sticky_spill_kv_usage: float = 0.9,
        seed: Optional[int] = None,
        max_inflight_per_replica: Optional[int] = None,
        policy_options: Optional[dict[str, Any]] = None,
    ) -> None:
        self.full_determinism = full_determinism
        if full_determinism:
            policy, policy_options = "rendezvous", None  # the configured policy's knobs are not its
        if policy is None:
            policy = "least_inflight"
        if isinstance(policy, str):
            self._policy: RoutingPolicy = get_policy(policy, seed=seed, **(policy_options or {}))
        else:
            self._policy = policy
        self._sticky_enabled = sticky
        self._spill_allowed = not (full_determinism or self._policy.deterministic)
        self._factor = sticky_overload_factor
        self._slack = sticky_overload_slack
        self._spill_kv = sticky_spill_kv_usage
        self.dispatch_limit = max_inflight_per_replica
        #: Hold back siblings of a placed prompt too (an ordered dispatch decides when they go;
        #: see :mod:`rollfleet.client.dispatch`); session turns are never held.
        self.hold_placed = False
        #: Called when a held-back request may find room: ``on_room(False)`` after one of this
        #: balancer's requests finished (one slot), ``on_room(True)`` after a load report or a
        #: membership change (any number), or when no replica is left to wait for (held requests
        #: then wait out the outage in the client's retry policy, which bounds it).
        self.on_room: Optional[Callable[[bool], None]] = None
        self._servers: dict[str, ServerState] = {}
        #: Removed replicas whose requests from here are still in flight (until they are released).
        self._departed = Departed()
        self._views: Optional[list[ReplicaView]] = None  # of the routable replicas (None: to rebuild)
        self._request_id_to_server: LRUCache[str, str] = LRUCache(maxsize=max_cache_size)
        self._preferred: Optional[frozenset[str]] = None  # see set_preferred
        #: The newest weight version each session's outputs carried: its next turn goes to no
        #: replica known to be on an older one (see :meth:`observe_output`).
        self._floors = VersionFloors(max_cache_size)
        #: Sent with every request; replicas count this balancer's requests under it.
        self.client_id = uuid.uuid4().hex[:16]
        self.decisions: Counter[str] = Counter()
        self.add_servers(servers)

    # ------------------------------------------------------------------ hot path
    def acquire_server(
        self, request_id: str, prompt_len: int = 0, prompt_ids: Optional[Sequence[int]] = None
    ) -> tuple[str, Any]:
        """Pick a replica for ``request_id``, count the request on it, return ``(id, handle)``.
        ``prompt_ids`` feed a policy that places equal prompts together (``uses_prefix``)."""
        acquired = self._acquire(request_id, prompt_len, prompt_ids, hold=False)
        assert acquired is not None  # never held without hold
        return acquired

    def try_acquire_server(
        self, request_id: str, prompt_len: int = 0, prompt_ids: Optional[Sequence[int]] = None
    ) -> Optional[tuple[str, Any]]:
        """:meth:`acquire_server`, or None while the request is held back by the dispatch limit: it
        starts a new placement (no sticky replica, no placed sibling) and every replica it may go
        to has ``max_inflight_per_replica`` requests in flight or more."""
        return self._acquire(request_id, prompt_len, prompt_ids, hold=self.dispatch_limit is not None)

    def _acquire(
        self, request_id: str, prompt_len: int, prompt_ids: Optional[Sequence[int]], hold: bool
    ) -> Optional[tuple[str, Any]]:
        servers = self._servers
        sticky_id = self._request_id_to_server.get(request_id) if self._sticky_enabled else None
        chosen: Optional[str] = None
        reason = "least_loaded"
        if sticky_id is not None:
            hold = False  # a session going on: never held, wherever its turn goes
            state = servers.get(sticky_id)
            if state is None or not state.routable:
                # the entry stays until a new replica is chosen: with none routable at all (the
                # whole fleet syncing or restarting) the retry finds its own replica again
                reason = "sticky_invalidated"
            elif self._spill_allowed and self._overloaded(sticky_id):
                reason = "spill_over"
            else:
                chosen, reason = sticky_id, "sticky"
        if chosen is None:
            candidates, narrowed = self._placeable()
            if narrowed and reason == "least_loaded":
                reason = "newest_version"
            if not candidates:
                if servers:
                    raise NoServerAvailable(f"none of {len(servers)} replicas is routable (unhealthy or stale weights)")
                raise NoServerAvailable()
            floor = self._floors.get(request_id)
            if floor is not None:  # a session going on: never held (like a sticky turn)
                candidates, reason, chosen = at_or_above(floor, candidates, self.version_of, reason, sticky_id)
                hold = False
        if chosen is None:
            key = prefix_key(prompt_ids) if self._policy.uses_prefix and prompt_ids is not None else None
            if hold and (self.hold_placed or not self._policy.has_home(key, candidates)):
                limit = self.dispatch_limit
                assert limit is not None
                candidates = [c for c in candidates if c.inflight < limit]
                if not candidates:
                    return None
            if key is not None:
                chosen = self._policy.select(candidates, request_id, prompt_len, prefix_key=key)
            else:
                chosen = self._policy.select(candidates, request_id, prompt_len)
            if self._sticky_enabled:
                self._request_id_to_server[request_id] = chosen
        state = servers[chosen]
        state.local += 1
        state.local_tokens += prompt_len
        state.sync()
        self.decisions[reason] += 1
        return chosen, state.handle

    def _placeable(self) -> tuple[list[ReplicaView], bool]:
        """The live views of the replicas a new placement may go to, and whether the preferred
        set narrowed them. The routable list is rebuilt only when membership or health changes;
        callers filter into new lists, never into it."""
        if self._views is None:
            self._views = [s.view for s in self._servers.values() if s.routable]
        if self._preferred is not None:
            preferred = [v for v in self._views if v.replica_id in self._preferred]
            if preferred:
                return preferred, True
        return self._views, False

    def free_slots(self) -> Optional[dict[str, int]]:
        """Requests the dispatch limit lets through now, per replica a new placement may go to.
        None when nothing would be held: no limit, or no replica is routable (an acquire then
        fails at once with NoServerAvailable, which callers wait out)."""
        limit = self.dispatch_limit
        views, _ = self._placeable()
        if limit is None or not views:
            return None
        return {v.replica_id: max(0, math.ceil(limit - v.inflight)) for v in views}

    def release_server(self, server_id: str, prompt_len: int = 0, handle: Any = None) -> None:
        """Uncount one request; unknown ids and extra releases are ignored (counts floor at 0).
        ``handle``, the one its acquire returned, tells a request sent before its replica was
        removed (uncounted there) from one sent to a replica re-added under the same id since."""
        state = self._servers.get(server_id)
        current = state.handle if state is not None else None
        if self._departed.release(server_id, handle, current, prompt_len) or state is None:
            if self.on_room is not None:
                self.on_room(False)
            return
        if state.local > 0:
            state.local -= 1
            state.local_tokens = max(0, state.local_tokens - prompt_len)
            state.sync()
        self._policy.on_request_done(server_id)
        if self.on_room is not None:
            self.on_room(False)

    def observe_output(self, server_id: str, request_id: str, output: TokenOutput) -> None:
        """Learn from an attempt's output the weight version its replica serves (at least the one
        its last token was sampled with: fresher than a snapshot taken before a commit) and raise
        the session's version floor to it."""
        extra = output.extra_fields
        self.observe_version(server_id, request_id, extra.get("max_global_steps", extra.get("global_steps")))

    def observe_version(self, server_id: str, request_id: str, version: Optional[int]) -> None:
        """A version ``server_id`` sampled ``request_id``'s tokens with (an output's newest, or the
        newest a stream cut short delivered): the replica serves at least that one, and the
        session's next turn or resume goes to no replica known to be older."""
        if version is None:
            return
        self.set_version(server_id, version)
        self._floors.raise_to(request_id, version)

    def version_of(self, server_id: str) -> Optional[int]:
        """The newest weight version ``server_id`` is known to serve (None: not known, or no such replica)."""
        state = self._servers.get(server_id)
        return state.version if state is not None else None

    def set_version(self, server_id: str, version: Optional[int]) -> None:
        """A weight version a replica is known to serve: the fleet's snapshot label, or an output's.
        Labels may lag a commit (they move when the version is published), so an older one never
        lowers what an output already showed (only :meth:`forget_versions` does)."""
        state = self._servers.get(server_id)
        if state is not None and version is not None and (state.version is None or version > state.version):
            state.version = version

    def forget_versions(self) -> None:
        """The fleet went back to older weights (a learner restored from a checkpoint): versions
        seen before say nothing about the replicas now, nor about sessions' floors."""
        for state in self._servers.values():
            state.version = None
        self._floors.clear()

    def _overloaded(self, server_id: str) -> bool:
        load = self._servers[server_id]
        if load.waiting <= 0 and load.kv_usage < self._spill_kv:
            return False  # it runs everything it has: its prefix cache is worth more
        routable = [s for s in self._servers.values() if s.routable]
        if len(routable) < 2:
            return False
        mean = sum(s.others + s.local for s in routable) / len(routable)
        load_n = load.others + load.local
        return load_n > self._factor * mean and load_n > mean + self._slack

    def finish_session(self, request_id: str) -> bool:
        """Forget a finished trajectory's sticky entry and version floor (verl never does; its LRU
        fills up)."""
        self._floors.forget(request_id)
        return self._request_id_to_server.pop(request_id, None) is not None

    def unstick(self, request_id: str) -> None:
        """Let a session's next turn be placed afresh (its replica just failed it); the session
        goes on, and so do its version floor and its turns' exemption from the dispatch limit."""
        if self._sticky_enabled and request_id in self._request_id_to_server:
            self._request_id_to_server[request_id] = _REPLACE

    def sticky_server(self, request_id: str) -> Optional[str]:
        """The routable replica the session's next turn goes to, if it has one."""
        server_id = self._request_id_to_server.get(request_id)
        return server_id if server_id and self.is_routable(server_id) else None

    def is_placed(self, request_id: str, prompt_ids: Optional[Sequence[int]] = None) -> bool:
        """Whether ``request_id`` is a session already placed (its turns are never held back),
        even where its replica has left or failed it since, or where stickiness is off and only
        its version floor says it is one; with ``prompt_ids``, also a sibling of a prompt the
        policy has placed, unless the dispatch order holds those too (as :meth:`try_acquire_server`
        would pass either at once)."""
        if request_id in self._request_id_to_server or self._floors.get(request_id) is not None:
            return True
        if prompt_ids is None or self.hold_placed or not self._policy.uses_prefix:
            return False
        return self._policy.has_home(prefix_key(prompt_ids), self._placeable()[0])

    # ------------------------------------------------------------------ verl-compatible API
    def clear_sticky_cache(self) -> dict[str, Any]:
        cleared = len(self._request_id_to_server)
        self._request_id_to_server.clear()
        return {"cleared_entries": cleared, "server_loads": self._loads()}

    def get_status(self) -> dict[str, Any]:
        return {
            "servers": self._loads(),
            "total_inflight": self.get_total_inflight(),
            "active_servers": sum(1 for s in self._servers.values() if s.routable),
            "registered_handles": len(self._servers),
            "policy": self._policy.name,
            "sticky_sessions": len(self._request_id_to_server),
            "estimated_load": {sid: s.others + s.local for sid, s in self._servers.items()},
            "decisions": dict(self.decisions),
        }

    @property
    def policy(self) -> RoutingPolicy:
        return self._policy


__all__ = ["GlobalRequestLoadBalancer"]
