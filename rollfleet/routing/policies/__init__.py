"""Routing policies, chosen by name.

Built-ins: ``least_inflight`` (verl's baseline), ``least_tokens``, ``power_of_two``,
``rendezvous`` (deterministic; used for ``full_determinism``), ``prefix_affinity`` (the config's
default: requests with one prompt, e.g. a GRPO group, share a replica within a load bound; it won
``benchmarks/routing_quality.py``). They are registered by import path
and imported when first used.

To add one: subclass :class:`RoutingPolicy` in a module of its own, implement ``select``, and call
``register_policy("name", cls)`` (or ``register_policy("name", "pkg.module:Class")``); the config's
``routing.policy`` can then name it (checked when the config is built). Every policy is built as
``cls(seed=seed)``: a policy without randomness simply ignores the seed (the base class accepts it).
A policy with knobs of its own gets a config section named after it (``routing.prefix_affinity``),
whose fields reach its constructor as keywords (``RoutingConfig.policy_options``).
"""

from __future__ import annotations

from typing import Any, Optional

from rollfleet.registry import Registry
from rollfleet.routing.policies.base import ReplicaView, RoutingPolicy
from rollfleet.routing.policies.rendezvous import rendezvous_score

POLICIES: Registry[type[RoutingPolicy]] = Registry(
    "routing policy",
    kind=RoutingPolicy,
    builtins={
        "least_inflight": "rollfleet.routing.policies.least_inflight:LeastInflightPolicy",
        "least_tokens": "rollfleet.routing.policies.least_tokens:LeastTokensPolicy",
        "power_of_two": "rollfleet.routing.policies.power_of_two:PowerOfTwoPolicy",
        "rendezvous": "rollfleet.routing.policies.rendezvous:RendezvousPolicy",
        "prefix_affinity": "rollfleet.routing.policies.prefix_affinity:PrefixAffinityPolicy",
    },
)


def register_policy(name: str, cls: type[RoutingPolicy] | str) -> None:
    """Make ``cls`` (a :class:`RoutingPolicy` subclass or its import path) available as ``name``."""
    POLICIES.register(name, cls)


def get_policy(name: str, seed: Optional[int] = None, **kwargs: Any) -> RoutingPolicy:
    """A new instance of policy ``name``; ``UnknownName`` (a ``ValueError``) lists the valid ones."""
    return POLICIES.get(name)(seed=seed, **kwargs)


def available_policies() -> list[str]:
    return POLICIES.names()


__all__ = [
    "POLICIES",
    "ReplicaView",
    "RoutingPolicy",
    "register_policy",
    "get_policy",
    "available_policies",
    "rendezvous_score",
]
