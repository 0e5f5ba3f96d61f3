"""The routing-policy interface: pick a replica from a snapshot of replica state.

A policy is a small object with one required method, :meth:`RoutingPolicy.select`, and optional
hooks that default to no-ops. It never does I/O and never blocks: the balancer calls it on the hot
path of every request, in the caller's process.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence


@dataclass(slots=True)
class ReplicaView:
    """What a policy may look at: the router's best estimate of one routable replica's load.

    Live: the balancer updates it in place as its counts change, so it is valid for the call it
    is passed to; a policy that keeps something across calls keeps ``replica_id``, not the view.
    """

    replica_id: str
    #: Requests in flight (others' as last reported by the replica, plus this router's own, live).
    inflight: float
    #: Prompt tokens of those requests.
    inflight_tokens: float
    kv_usage: float = 0.0


class RoutingPolicy(abc.ABC):
    name: ClassVar[str] = "policy"

    #: True when the choice must be reproducible across processes (no randomness, no load).
    deterministic: ClassVar[bool] = False

    #: True when ``select`` uses ``prefix_key`` (a digest of the prompt, equal for requests with
    #: the same prompt): the balancer computes it only for such policies, and calls the others
    #: without it, so a policy written before the argument existed keeps working.
    uses_prefix: ClassVar[bool] = False

    def __init__(self, seed: Optional[int] = None) -> None:
        """Every policy is built as ``cls(seed=seed)``; one without randomness ignores the seed."""

    @abc.abstractmethod
    def select(
        self, candidates: Sequence[ReplicaView], request_id: str, prompt_len: int, prefix_key: Optional[int] = None
    ) -> str:
        """Return the ``replica_id`` of one of ``candidates`` (never empty)."""

    def has_home(self, prefix_key: Optional[int], candidates: Sequence[ReplicaView]) -> bool:
        """True when a request with this prompt follows a placement the policy already made (a
        sibling of a placed prompt) and :meth:`select` would send it there, among ``candidates``:
        the balancer's dispatch limit does not hold it back."""
        return False

    def on_request_done(self, replica_id: str) -> None:
        """Called when a request routed by this policy has finished."""

    def on_servers_changed(self, replica_ids: Sequence[str]) -> None:
        """Called when the set of known replicas changes."""
