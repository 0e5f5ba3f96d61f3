"""Routing policies, chosen by name.

Built-ins: ``least_inflight`` (verl's baseline), ``least_tokens`` (default), ``power_of_two``,
``rendezvous`` (deterministic; used for ``full_determinism``). To add one: subclass
:class:`RoutingPolicy` in a module of its own, implement ``select``, and call
``register_policy("name", cls)``; the config's ``routing.policy`` can then name it.
"""

from __future__ import annotations

from typing import Any, Optional

from rollfleet.routing.policies.base import ReplicaView, RoutingPolicy
from rollfleet.routing.policies.least_inflight import LeastInflightPolicy
from rollfleet.routing.policies.least_tokens import LeastTokensPolicy
from rollfleet.routing.policies.power_of_two import PowerOfTwoPolicy
from rollfleet.routing.policies.rendezvous import RendezvousPolicy, rendezvous_score

_POLICIES: dict[str, type[RoutingPolicy]] = {}


def register_policy(name: str, cls: type[RoutingPolicy]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, RoutingPolicy)):
        raise TypeError(f"routing policy '{name}' must subclass RoutingPolicy, got {cls!r}")
    if name in _POLICIES:
        raise ValueError(f"routing policy '{name}' is already registered")
    _POLICIES[name] = cls


def get_policy(name: str, seed: Optional[int] = None, **kwargs: Any) -> RoutingPolicy:
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy '{name}'; valid policies: {sorted(_POLICIES)}") from None
    if cls is LeastInflightPolicy:
        return cls(**kwargs)
    return cls(seed=seed, **kwargs)


def available_policies() -> list[str]:
    return sorted(_POLICIES)


for _cls in (LeastInflightPolicy, LeastTokensPolicy, PowerOfTwoPolicy, RendezvousPolicy):
    register_policy(_cls.name, _cls)

__all__ = [
    "ReplicaView",
    "RoutingPolicy",
    "register_policy",
    "get_policy",
    "available_policies",
    "rendezvous_score",
]
