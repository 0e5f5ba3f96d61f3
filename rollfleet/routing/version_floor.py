"""A session's weight-version floor: its turns never go back a version.

A trajectory's tokens are meant to come from one policy version, or from newer ones as weights are
pushed mid-rollout (``min_global_steps`` / ``max_global_steps`` bound them; off-policy corrections
and the staleness limit read them). Within one replica that holds by itself: its weights only move
forward. A session that leaves its replica (it was saturated, or it died) could land on one still
on the old weights, while a rolling update commits wave by wave, or in the moment between a commit
and the snapshot that tells this client about it. So the balancer remembers the newest version each
session's outputs carried and places its next turn only on replicas known to be as new.
"""

from __future__ import annotations

from typing import Callable, Optional

from cachetools import LRUCache

from rollfleet.routing.policies import ReplicaView


class VersionFloors:
    """The newest weight version each live session's outputs carried (LRU-bounded, like the
    sticky table beside it)."""

    def __init__(self, maxsize: int) -> None:
        self._floors: LRUCache[str, int] = LRUCache(maxsize=maxsize)

    def get(self, request_id: str) -> Optional[int]:
        return self._floors.get(request_id)

    def raise_to(self, request_id: str, version: int) -> None:
        floor = self._floors.get(request_id)
        if floor is None or version > floor:
            self._floors[request_id] = version

    def forget(self, request_id: str) -> None:
        self._floors.pop(request_id, None)

    def clear(self) -> None:
        self._floors.clear()


def at_or_above(
    floor: int,
    candidates: list[ReplicaView],
    version_of: Callable[[str], Optional[int]],
    reason: str,
    sticky_id: Optional[str],
) -> tuple[list[ReplicaView], str, Optional[str]]:
    """Narrow a session's placement to replicas on weights at least ``floor`` (a replica whose
    version is not known passes). Returns ``(candidates, reason, chosen)``:

    - some replica other than the session's own qualifies: those, for the policy to pick from;
    - none does, and the session was leaving its replica for load: it stays there
      (``version_floor``: a saturated replica beats a step back; ``version_regressed`` if that
      replica is itself below the floor, after an earlier regression);
    - none does and its replica is gone: every routable one (``version_regressed``: counted, not
      refused; refusing would lose the trajectory).
    """
    fitting = [c for c in candidates if (v := version_of(c.replica_id)) is None or v >= floor]
    if len(fitting) == len(candidates):
        return candidates, reason, None
    if any(c.replica_id != sticky_id for c in fitting):
        return fitting, reason, None
    if sticky_id is not None and reason == "spill_over":
        sticky_fits = any(c.replica_id == sticky_id for c in fitting)
        return candidates, "version_floor" if sticky_fits else "version_regressed", sticky_id
    if fitting:
        return fitting, reason, None
    return candidates, "version_regressed", None


__all__ = ["VersionFloors", "at_or_above"]
