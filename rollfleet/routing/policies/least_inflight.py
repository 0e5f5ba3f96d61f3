"""verl's policy, kept as the baseline: fewest in-flight requests, ties to the first replica.

Kept exactly as verl behaves (ties always go to the first replica in insertion order) so that
benchmarks compare against the real thing. Its weakness: it counts requests, not their size.
"""

from __future__ import annotations

from typing import Optional, Sequence

from rollfleet.routing.policies.base import ReplicaView, RoutingPolicy


class LeastInflightPolicy(RoutingPolicy):
    name = "least_inflight"

    def select(
        self, candidates: Sequence[ReplicaView], request_id: str, prompt_len: int, prefix_key: Optional[int] = None
    ) -> str:
        best = candidates[0]
        for view in candidates[1:]:
            if view.inflight < best.inflight:
                best = view
        return best.replica_id
