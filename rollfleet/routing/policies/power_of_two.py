"""Power of two choices: sample two replicas, take the less loaded (tokens, then requests).

Nearly as balanced as a global minimum while tolerating stale load information: many routers
acting on the same slightly old snapshot do not all pile onto the same "least loaded" replica.
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

from rollfleet.routing.policies.base import ReplicaView, RoutingPolicy


class PowerOfTwoPolicy(RoutingPolicy):
    name = "power_of_two"

    def __init__(self, seed: Optional[int] = None) -> None:
        self._rng = random.Random(seed)

    def select(
        self, candidates: Sequence[ReplicaView], request_id: str, prompt_len: int, prefix_key: Optional[int] = None
    ) -> str:
        if len(candidates) == 1:
            return candidates[0].replica_id
        a, b = self._rng.sample(range(len(candidates)), 2)
        va, vb = candidates[a], candidates[b]
        return (
            va.replica_id if (va.inflight_tokens, va.inflight) <= (vb.inflight_tokens, vb.inflight) else vb.replica_id
        )
