"""Fewest in-flight prompt tokens, then fewest requests; ties broken at random.

Agentic multi-turn prompts differ in length by 100x; counting requests (verl) puts a 30k-token
turn and a 300-token turn on the same footing. Tokens in flight track prefill work and KV
pressure; random tie-breaking avoids verl's pile-up on the first replica when loads are equal.
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

from rollfleet.routing.policies.base import ReplicaView, RoutingPolicy


class LeastTokensPolicy(RoutingPolicy):
    name = "least_tokens"

    def __init__(self, seed: Optional[int] = None) -> None:
        self._rng = random.Random(seed)

    def select(
        self, candidates: Sequence[ReplicaView], request_id: str, prompt_len: int, prefix_key: Optional[int] = None
    ) -> str:
        best_key = None
        best: list[str] = []
        for view in candidates:
            key = (view.inflight_tokens, view.inflight)
            if best_key is None or key < best_key:
                best_key, best = key, [view.replica_id]
            elif key == best_key:
                best.append(view.replica_id)
        return best[0] if len(best) == 1 else self._rng.choice(best)
