"""Requests with the same prompt go to one replica, within a bound on its load.

A GRPO group is n samples of one prompt, sent at once. Every load-only policy spreads them over
the fleet, so each replica the group touches prefills the prompt again: measured in virtual time
(``benchmarks/routing_quality.py``) ``least_inflight`` and ``least_tokens`` prefilled a group's
prompt 4.00 times on 4 replicas. This policy remembers where a prompt went (its home, chosen as
the least loaded replica when the first sibling arrives) and sends the siblings there, so the
prompt is prefilled once and the rest hit the prefix cache.

Affinity never outweighs balance: the home is taken only while its in-flight requests stay within
``load_factor`` x the fleet's mean plus ``slack`` (consistent hashing with bounded loads applies
the same idea to hash rings); past that the request goes to the least loaded replica, which
becomes the prompt's home. Because homes are chosen by load, whole groups spread as evenly as
single requests do (one group of imbalance at most), which hashing the prompt to a replica would
not. Homes live in the client (an LRU of prompt keys); siblings sent by different clients may
find different homes, as they would under any per-client policy.
"""

from __future__ import annotations

from typing import Optional, Sequence

from cachetools import LRUCache

from rollfleet.errors import InvalidRequest
from rollfleet.routing.policies.base import ReplicaView
from rollfleet.routing.policies.least_tokens import LeastTokensPolicy


class PrefixAffinityPolicy(LeastTokensPolicy):
    """``least_tokens`` for a request with a new prompt; its prompt's home for the next ones.

    Args:
        seed: tie-breaks between equally loaded replicas.
        load_factor, slack: a home is kept while its in-flight requests (counting this one) are
            at most ``load_factor * mean + slack``; ``slack`` lets a whole group (n <= slack)
            share a home on an idle fleet, ``load_factor`` bounds the imbalance once it is busy.
        max_homes: prompt keys remembered (LRU).
    """

    name = "prefix_affinity"
    uses_prefix = True

    def __init__(
        self, seed: Optional[int] = None, load_factor: float = 1.25, slack: float = 16, max_homes: int = 65536
    ) -> None:
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1 (the mean itself), got {load_factor}")
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        super().__init__(seed)
        self.load_factor = load_factor
        self.slack = slack
        self._homes: LRUCache[int, str] = LRUCache(maxsize=max_homes)

    def select(
        self, candidates: Sequence[ReplicaView], request_id: str, prompt_len: int, prefix_key: Optional[int] = None
    ) -> str:
        home = self._homes.get(prefix_key) if prefix_key is not None else None
        if home is not None:
            if self._within_bound(home, candidates):
                return home
            if len(candidates) > 1:  # over its bound: elsewhere, though its tokens may be fewest
                candidates = [c for c in candidates if c.replica_id != home]
        chosen = super().select(candidates, request_id, prompt_len)  # least_tokens
        if prefix_key is not None:
            self._homes[prefix_key] = chosen
        return chosen

    def has_home(self, prefix_key: Optional[int], candidates: Sequence[ReplicaView]) -> bool:
        home = self._homes.get(prefix_key) if prefix_key is not None else None
        return home is not None and self._within_bound(home, candidates)

    def _within_bound(self, home: str, candidates: Sequence[ReplicaView]) -> bool:
        """Whether ``home`` is among ``candidates`` with room for one more under the bound."""
        view = next((c for c in candidates if c.replica_id == home), None)
        return view is not None and view.inflight + 1 <= self._bound(candidates)

    def _bound(self, candidates: Sequence[ReplicaView]) -> float:
        mean = (sum(c.inflight for c in candidates) + 1) / len(candidates)
        return self.load_factor * mean + self.slack

    def on_servers_changed(self, replica_ids: Sequence[str]) -> None:
        """Forget homes on replicas that left (a restarted replica's cache is empty anyway)."""
        live = set(replica_ids)
        for key in [k for k, rid in self._homes.items() if rid not in live]:
            del self._homes[key]


def prefix_key(prompt_ids: Sequence[int]) -> int:
    """The key siblings share: a digest of the whole prompt (Python hashes int tuples the same in
    every process; only str and bytes hashing is salted). A prompt holding an id that cannot be
    hashed (a list) is the caller's mistake: ``InvalidRequest`` naming that element."""
    try:
        return hash(tuple(prompt_ids))
    except TypeError:
        for i, tok in enumerate(prompt_ids):
            try:
                hash(tok)
            except TypeError:
                raise InvalidRequest(f"prompt_ids[{i}]", "an integer token id", tok) from None
        raise
