"""``routing.dispatch_order: fifo``: held requests go in arrival order; the base of every order."""

from __future__ import annotations

import asyncio
import heapq
from itertools import count
from typing import Callable, ClassVar, Optional, Sequence

#: Free dispatch slots per replica a new placement may go to (None: nothing would be held, e.g. no
#: replica is routable; waiters then try, and fail with NoServerAvailable, which the client's retry
#: policy waits out).
RoomFn = Callable[[], Optional[dict[str, int]]]


class DispatchGate:
    """The FIFO waiting room: one waiter woken per finished request of this client (one slot
    freed), all of them when a load report or a membership change may have freed more. Waiters
    that find no room again go back to the front of the line, in the order they had."""

    #: Siblings of a placed prompt wait here too (the balancer holds them back).
    holds_placed: ClassVar[bool] = False

    def __init__(self, room: Optional[RoomFn] = None, limit: int = 0, lookahead: float = 1.0) -> None:
        """Every order is built with the balancer's free slots (``room``), its dispatch ``limit``
        and ``routing.dispatch_lookahead``; this one reads only whether any replica is routable."""
        self._room_fn = room
        #: The line, by arrival: (arrival, entry, future, request id). A waiter cancelled in line
        #: stays until it reaches the top (its future is done), so ``_live`` counts the line.
        self._line: list[tuple[int, int, asyncio.Future[None], str]] = []
        self._live = 0
        self._arrivals = count()
        #: Woken waiters' arrivals by request id: one that finds no room goes back to its place
        #: (put back at the very front one by one, those woken together came out reversed, and
        #: every load refresh wakes them all).
        self._places: dict[str, int] = {}
        #: Waiters woken that have not tried yet: a woken one runs a loop step later, and a request
        #: arriving meanwhile must not take the slot it was woken for.
        self._woken = 0

    @property
    def waiting(self) -> int:
        return self._live

    def may_try(self, placed: bool) -> bool:
        """Whether a request that just arrived may try for a replica before it waits (``placed``:
        it is a session's next turn): at once only while nobody waits or is woken ahead of it, or
        while no replica is routable (see :meth:`_unroutable`)."""
        return placed or not (self._live or self._woken) or self._unroutable()

    def _unroutable(self) -> bool:
        """No replica a new placement may go to: nothing is held then. Each request tries, fails
        with NoServerAvailable, and waits in the retry policy (bounded by ``retry.no_server_wait_s``):
        held here, a request whose woken turn failed came back to a line that only a release
        wakes, and once the requests in flight had drained it waited for good."""
        return self._room_fn is not None and self._room_fn() is None

    async def wait(
        self, front: bool = False, *, request_id: str = "", prompt_ids: Optional[Sequence[int]] = None
    ) -> None:
        """Until :meth:`wake` picks this waiter (``front``: it was woken before and found no room:
        it keeps its place in the line). Not at all while nothing is routable."""
        if self._unroutable():
            self._places.pop(request_id, None)
            return
        place = self._places.pop(request_id, None) if front else None
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        arrival = next(self._arrivals)  # also the entry's own number: two entries never tie
        if place is None:  # new, or sent to the front without a place of its own here: the very front
            place = -arrival if front else arrival
        heapq.heappush(self._line, (place, arrival, future, request_id))
        self._live += 1
        try:
            await future
        except asyncio.CancelledError:
            if future.cancelled():  # still in line
                self._live -= 1
            else:  # it was picked, then cancelled: the slot goes to the next
                self._woken -= 1
                self._places.pop(request_id, None)
                self.wake(everyone=False)
            raise
        self._woken -= 1  # its caller tries now, before anything else runs

    def wake(self, everyone: bool) -> None:
        """Let the first waiter (``everyone``: all of them) try again."""
        while self._line:
            place, _, future, request_id = heapq.heappop(self._line)
            if future.done():  # cancelled in line
                continue
            future.set_result(None)
            self._live -= 1
            self._woken += 1
            self._places[request_id] = place
            if not everyone:
                return

    def dispatched(self, request_id: str, prompt_ids: Sequence[int], replica_id: str) -> None:
        """A request woken here got ``replica_id``. The next waiter tries too: two slots may have
        freed in one tick while one request was held, and one that arrived meanwhile queued
        behind it (:meth:`may_try`); no release would wake it for the second."""
        self._places.pop(request_id, None)
        if self._live:
            self.wake(everyone=False)

    def finished(self, request_id: str, ended: bool = True) -> None:
        """An attempt of a request of this client is over, whatever its outcome (``ended``: it
        returned an output that was not aborted; an aborted or failed attempt may be resumed or
        retried under the same id)."""
        self._places.pop(request_id, None)


__all__ = ["DispatchGate", "RoomFn"]
