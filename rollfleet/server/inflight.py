"""What a replica has in flight, counted three ways: in all, per client, per session.

* **In all** (requests and their prompt tokens): the load every router reads.
* **Per client** (``client_id``: the id of the router, one per fleet client, that sent the
  request): a router subtracts its own share *as counted here* from the total to learn everyone
  else's load. Its own count at the time a report arrives is the wrong thing to subtract: a polled
  report is up to a probe interval old, and the router's requests that finished since would show
  up as phantom load of others (measured: 24 phantom requests on a replica that had none, and a
  gateway's 32 sticky sessions split 22/10 over two replicas that a Rust router split 16/16).
* **Per session** (``request_id``): the engine ids of a session's attempts, so that
  :meth:`~rollfleet.server.replica.Replica.abort` can abort a whole session.
* **Held** at the replica's gate (paused, asleep): the engine has not seen these, so an abort
  cannot go to it; it is marked here, and the attempt ends ``aborted`` when the gate opens
  instead of generating in full after the resume.

Counting in and out is one context manager, so no exit path (error, cancellation) leaks a count.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional


class InflightBook:
    """The replica's in-flight counts; see the module docstring."""

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        self._by_client: dict[str, list[int]] = {}  # client_id -> [requests, tokens]
        self._sessions: dict[str, set[str]] = {}  # request_id -> engine ids
        self._held: dict[str, bool] = {}  # engine ids held at the gate -> aborted meanwhile

    @contextlib.contextmanager
    def entry(self, request_id: str, engine_id: str, tokens: int, client_id: Optional[str]) -> Iterator[None]:
        """Count one request in for the duration of the block, out however the block ends."""
        # Every lookup before any count: a key that cannot be one (the replica refuses it first)
        # must not leave counts behind.
        mine = self._by_client.setdefault(client_id, [0, 0]) if client_id is not None else None
        ids = self._sessions.setdefault(request_id, set())
        ids.add(engine_id)
        self.requests += 1
        self.tokens += tokens
        if mine is not None:
            mine[0] += 1
            mine[1] += tokens
        try:
            yield
        finally:
            self.requests -= 1
            self.tokens -= tokens
            if mine is not None:
                mine[0] -= 1
                mine[1] -= tokens
                if mine[0] <= 0:
                    self._by_client.pop(client_id, None)  # type: ignore[arg-type]
            ids.discard(engine_id)
            if not ids:
                self._sessions.pop(request_id, None)

    def engine_ids(self, request_id: str) -> list[str]:
        """The engine ids of a session's attempts in flight."""
        return list(self._sessions.get(request_id, ()))

    def hold(self, engine_id: str) -> None:
        """An attempt waits at the gate (the engine has not seen it)."""
        self._held[engine_id] = False

    def release(self, engine_id: str) -> bool:
        """It leaves the gate; whether it was aborted while it waited."""
        return self._held.pop(engine_id, False)

    def is_held(self, engine_id: str) -> bool:
        return engine_id in self._held

    def abort_held(self, engine_ids: Optional[list[str]] = None) -> int:
        """Mark the held attempts among ``engine_ids`` (None: all) aborted; how many were not yet."""
        marked = 0
        for engine_id in self._held if engine_ids is None else engine_ids:
            if self._held.get(engine_id) is False:
                self._held[engine_id] = True
                marked += 1
        return marked

    def by_client(self, client_id: Optional[str] = None) -> dict[str, tuple[int, int]]:
        """``client_id``'s share (zeros when it has none in flight), or every client's (None)."""
        if client_id is None:
            return {cid: (n, t) for cid, (n, t) in self._by_client.items()}
        n, t = self._by_client.get(client_id, (0, 0))
        return {client_id: (n, t)}


__all__ = ["InflightBook"]
