"""Rendezvous (highest-random-weight) hashing on the request id.

Deterministic across processes (a keyed BLAKE2b, not Python's per-process salted ``hash()``,
verl's weakness #4) and stable under membership change: adding or removing a replica only moves
the requests that hash highest to it, not ``1 - 1/n`` of all keys as ``hash % n`` does. Used for
``full_determinism``; it ignores load by design.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

from rollfleet.routing.policies.base import ReplicaView, RoutingPolicy


def rendezvous_score(replica_id: str, request_id: str) -> int:
    digest = hashlib.blake2b(f"{replica_id}\x00{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class RendezvousPolicy(RoutingPolicy):
    name = "rendezvous"
    deterministic = True

    def select(
        self, candidates: Sequence[ReplicaView], request_id: str, prompt_len: int, prefix_key: Optional[int] = None
    ) -> str:
        return max(candidates, key=lambda v: (rendezvous_score(v.replica_id, request_id), v.replica_id)).replica_id
