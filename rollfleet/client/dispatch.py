"""Late binding: requests held in the client until a replica has room (``routing.max_inflight_per_replica``).

Without a limit a client sends every request at once and each replica's engine queues what it
cannot run yet: a GRPO batch of thousands of samples is committed to replicas at t=0, by counts,
before anyone knows how long the samples will be. With a limit, a request that would start a new
placement waits here until some replica it may go to has fewer requests in flight than the limit,
and then goes to the policy's choice among those: work lands on the replica that frees up first.
Requests that follow an earlier placement (a session's next turn, a sibling of a prompt the
policy has placed) are never held: their prefix cache is where it is.

Measured in virtual time (``benchmarks/routing_quality.py``, the capacity-bound GRPO workload):
see the README's routing-quality table for the numbers next to the same policy without a limit.

:class:`DispatchGate` is the waiting room: FIFO, one waiter woken per finished request of this
client (one slot freed), all of them when a load report or a membership change may have freed
more. A waiter that finds no room again goes back to the front of the line.
"""

from __future__ import annotations

import asyncio
from collections import deque


class DispatchGate:
    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def wait(self, front: bool = False) -> None:
        """Until :meth:`wake` picks this waiter (``front``: it was woken before and found no room)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if front:
            self._waiters.appendleft(future)
        else:
            self._waiters.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future in self._waiters:
                self._waiters.remove(future)
            elif future.done() and not future.cancelled():
                self.wake(everyone=False)  # it was picked, then cancelled: the slot goes to the next
            raise

    def wake(self, everyone: bool) -> None:
        """Let the first waiter (``everyone``: all of them) try again."""
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                future.set_result(None)
                if not everyone:
                    return


__all__ = ["DispatchGate"]
