"""What one client's balancer knows of one replica: its own requests there, others' as last
reported, health, weight version, and the live view its policy reads."""

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


__all__ = ["ServerState"]
