"""Late binding: requests held in the client until a replica has room (``routing.max_inflight_per_replica``).

Without a limit a client sends every request at once and each replica's engine queues what it
cannot run yet: a GRPO batch of thousands of samples is committed to replicas at t=0, by counts,
before anyone knows how long the samples will be. With a limit, a request that would start a new
placement waits here until some replica it may go to has fewer requests in flight than the limit,
and then goes to the policy's choice among those: work lands on the replica that frees up first.

Which held request goes next is ``routing.dispatch_order`` (:data:`DISPATCH_ORDERS`):

* ``fifo`` (:class:`DispatchGate`): arrival order. Requests that follow an earlier placement (a
  session's next turn, a sibling of a prompt the policy has placed) are never held: their prefix
  cache is where it is.
* ``longest_group_first`` (:class:`LongestGroupFirstGate`): one sample of each prompt goes first
  (a probe), then the siblings of the prompts whose probes ran longest. Only session turns pass.

Each order is a module here (:mod:`.fifo`, :mod:`.longest_first`), named in :data:`DISPATCH_ORDERS`.
"""

from __future__ import annotations

from rollfleet.client.dispatch.fifo import DispatchGate, RoomFn
from rollfleet.client.dispatch.longest_first import LongestGroupFirstGate

#: ``routing.dispatch_order`` -> the gate that implements it.
DISPATCH_ORDERS: dict[str, type[DispatchGate]] = {"fifo": DispatchGate, "longest_group_first": LongestGroupFirstGate}


__all__ = ["DISPATCH_ORDERS", "DispatchGate", "LongestGroupFirstGate", "RoomFn"]
