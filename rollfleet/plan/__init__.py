"""Planning on a simulated fleet in virtual time: the real replica, client, balancer and routing
code, with engine steps that cost simulated time only (:mod:`rollfleet.utils.virtual_time`), so a
run gives the same numbers on any host, as fast as the host computes them.

``fleet``: :class:`VirtualFleet`, N sim replicas and a client in one process, and what a run
cost them (:class:`FleetReport`). ``runtime``: :class:`VirtualRuntime`, on which the real trainer
modes run against a virtual fleet and a :class:`VirtualLearner`.
"""

from rollfleet.plan.fleet import FleetReport, VirtualFleet
from rollfleet.plan.runtime import VirtualLearner, VirtualRuntime

__all__ = ["VirtualFleet", "FleetReport", "VirtualLearner", "VirtualRuntime"]
