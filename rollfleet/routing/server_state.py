"""What one client's balancer knows of one replica: its own requests there, others' as last
reported, health, weight version, and the live view its policy reads; and of replicas since
removed, the requests still in flight there."""

from __future__ import annotations

from typing import Any, Optional

from rollfleet.routing.policies import ReplicaView


class ServerState:
    __slots__ = (
        "handle", "local", "local_tokens", "others", "others_tokens", "kv_usage", "waiting", "routable",
        "reported_at", "view", "version",
    )  # fmt: skip

    def __init__(self, server_id: str, handle: Any) -> None:
        self.handle = handle
        #: What policies see of it, kept up to date in place (:meth:`sync`): a routing decision
        #: then costs no allocation per replica, which on a large fleet was most of its cost.
        self.view = ReplicaView(server_id, 0, 0)
        self.local = 0
        self.local_tokens = 0
        self.others = 0
        self.others_tokens = 0
        self.kv_usage = 0.0
        self.waiting = 0
        self.routable = True
        self.reported_at = float("-inf")  # the replica's clock: reports from one replica compare
        #: The newest weight version it is known to serve (None: not known), from the fleet's
        #: snapshot or from an output it returned, whichever is newer (see :meth:`observe_output`).
        self.version: Optional[int] = None

    def sync(self) -> None:
        view = self.view
        view.inflight = self.others + self.local
        view.inflight_tokens = self.others_tokens + self.local_tokens
        view.kv_usage = self.kv_usage


def same_handle(a: Any, b: Any) -> bool:
    """Whether two handles are one replica actor: the very object, or an equal copy (a handle
    that came through Ray or a snapshot is a new object for the same actor)."""
    return a is b or a == b


class Departed:
    """This client's requests still in flight on replicas removed from the fleet, per incarnation
    (a replica's handle): a replica re-added under the same id starts from its own count, and a
    release naming the handle its acquire returned uncounts the incarnation it was counted on."""

    def __init__(self) -> None:
        self._by_id: dict[str, list[ServerState]] = {}

    def add(self, server_id: str, state: ServerState) -> None:
        if state.local > 0:
            self._by_id.setdefault(server_id, []).append(state)

    def take_back(self, server_id: str, handle: Any) -> Optional[ServerState]:
        """The removed incarnation that is ``handle``, no longer departed: re-added as the very
        same actor, its requests there are its load again."""
        state = self._find(server_id, handle)
        if state is not None:
            self._drop(server_id, state)
        return state

    def release(self, server_id: str, handle: Any, current: Any = None, prompt_len: int = 0) -> bool:
        """Uncount one request on a removed incarnation of ``server_id``: the one that is
        ``handle``; without a handle, or with one that is neither a removed one's nor ``current``
        (the handle of the replica there now): the oldest (over for a while, never under). Such a
        handle is an earlier one of a replica restarted in place (a new handle, the same id) and
        removed since. False: the request was not sent to a removed one."""
        state = self._find(server_id, handle)
        if state is None and handle is not None and not same_handle(handle, current):
            state = self._find(server_id, None)
        if state is None:
            return False
        state.local -= 1
        # its tokens too: re-added as the very same actor, what is left is that replica's load
        state.local_tokens = max(0, state.local_tokens - prompt_len)
        if state.local <= 0:
            self._drop(server_id, state)
        return True

    def _find(self, server_id: str, handle: Any) -> Optional[ServerState]:
        states = self._by_id.get(server_id)
        if not states:
            return None
        if handle is None:
            return states[0]
        return next((s for s in states if same_handle(s.handle, handle)), None)

    def _drop(self, server_id: str, state: ServerState) -> None:
        states = self._by_id[server_id]
        states.remove(state)
        if not states:
            del self._by_id[server_id]


__all__ = ["Departed", "ServerState", "same_handle"]
