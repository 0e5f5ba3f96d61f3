"""Routing: which replica serves a request.

* :class:`GlobalRequestLoadBalancer` (verl's API) runs in the caller's process; sticky sessions
  and the caller's own in-flight counts live there, replica-reported load flows in.
* Policies are plug-ins (:mod:`rollfleet.routing.policies`).
* :mod:`rollfleet.routing.health` is the shared health view.
"""

from rollfleet.routing.balancer import GlobalRequestLoadBalancer
from rollfleet.routing.health import FleetSnapshot, HealthState, ReplicaRecord
from rollfleet.routing.policies import ReplicaView, RoutingPolicy, available_policies, get_policy, register_policy

__all__ = [
    "GlobalRequestLoadBalancer",
    "FleetSnapshot",
    "HealthState",
    "ReplicaRecord",
    "ReplicaView",
    "RoutingPolicy",
    "available_policies",
    "get_policy",
    "register_policy",
]
