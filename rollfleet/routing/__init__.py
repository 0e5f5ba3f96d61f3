"""Routing: which replica serves a request.

* :class:`GlobalRequestLoadBalancer` (verl's API) runs in the caller's process; sticky sessions
  and the caller's own in-flight counts live there, replica-reported load flows in.
* Policies are plug-ins (:mod:`rollfleet.routing.policies`).
* the shared health view lives in :mod:`rollfleet.health` (a contract of the bottom layer: the
  manager writes it, clients read it).
"""

from rollfleet.health import FleetSnapshot, HealthState, ReplicaRecord
from rollfleet.routing.balancer import GlobalRequestLoadBalancer
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
