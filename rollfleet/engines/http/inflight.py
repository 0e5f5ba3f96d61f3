"""The in-flight table: every ``generate`` call between entry and return, the gate that holds new
calls while the engine is paused or asleep, and the abort loop that makes aborted calls come back.

Why the engine holds calls itself rather than leaving it to the server: a call held here never
reaches the server, so ``abort`` releases it at once (it returns ``aborted`` with no tokens) and
``load()`` can count it as waiting. Holds are named (``pause``, ``sleep``) and independent, like
the sim engine's: resuming does not wake a sleeping engine.

Why aborts are re-sent: a request still on the wire when its abort lands is unknown to the server,
which ignores the abort (vLLM answers ``{"status": "aborted"}`` for any id; SGLang ignores a rid it
has not registered), and the request then runs to its end. :meth:`InflightTable.drain` waits,
bounded by :data:`DRAIN_TIMEOUT_S`, for the aborted calls to come back, and sends the abort again
every :data:`ABORT_RESEND_S` for those still out. Calls that arrive after the snapshot are left
alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable

logger = logging.getLogger(__name__)

#: Bounded wait for aborted requests to come back (abort, abort_all, pause, sleep).
DRAIN_TIMEOUT_S = 5.0
#: How often an abort is re-sent while its request is still out (covers a request in transit).
ABORT_RESEND_S = 0.1


@dataclass(eq=False)
class Inflight:
    """One ``generate`` call."""

    request_id: str  # the caller's id
    wire_id: str  # the id the server knows it by (unique among the calls in flight)
    tokens: int  # prompt + token budget: what the call may occupy
    sent: bool = False  # past the gate and on its way to (or at) the server
    #: Still out when a pause gave up waiting for it: it may run on weights loaded after the pause,
    #: so which weights sampled its tokens is unknown (unless the server labels them).
    outlived_pause: bool = False
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class InflightTable:
    def __init__(self) -> None:
        self._calls: dict[str, Inflight] = {}
        self._holds: set[str] = set()
        self._open = asyncio.Event()
        self._open.set()

    # ------------------------------------------------------------------ the table
    def add(self, call: Inflight) -> Inflight:
        self._calls[call.wire_id] = call
        return call

    def remove(self, call: Inflight) -> None:
        if self._calls.get(call.wire_id) is call:
            del self._calls[call.wire_id]
        call.done.set()

    def rename(self, call: Inflight, wire_id: str) -> None:
        """Send ``call`` again under a new wire id (the old one may have reached the server)."""
        if self._calls.get(call.wire_id) is call:
            del self._calls[call.wire_id]
        call.wire_id = wire_id
        self._calls[wire_id] = call

    def __contains__(self, wire_id: str) -> bool:
        return wire_id in self._calls

    def __len__(self) -> int:
        return len(self._calls)

    def calls(self) -> list[Inflight]:
        return list(self._calls.values())

    def of(self, request_id: str) -> list[Inflight]:
        return [c for c in self._calls.values() if c.request_id == request_id]

    def sent(self) -> list[Inflight]:
        return [c for c in self._calls.values() if c.sent]

    def held(self) -> int:
        """Calls waiting at the gate (not sent yet)."""
        return sum(1 for c in self._calls.values() if not c.sent)

    def tokens(self) -> int:
        return sum(c.tokens for c in self._calls.values())

    # ------------------------------------------------------------------ the gate
    def hold(self, reason: str) -> None:
        self._holds.add(reason)
        self._open.clear()

    def release(self, reason: str) -> None:
        self._holds.discard(reason)
        if not self._holds:
            self._open.set()

    def holding(self, reason: str) -> bool:
        return reason in self._holds

    async def wait_turn(self, call: Inflight, dead: asyncio.Event) -> None:
        """Return when the gate is open, ``call`` was aborted or the engine died (or shut down)."""
        while not self._open.is_set() and not call.aborted.is_set() and not dead.is_set():
            waits = [asyncio.ensure_future(e.wait()) for e in (self._open, call.aborted, dead)]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    # ------------------------------------------------------------------ aborting
    async def drain(
        self,
        calls: Iterable[Inflight],
        send_abort: Callable[[list[Inflight], bool], Awaitable[None]],
        alive: Callable[[], bool],
        *,
        send_first: bool = True,
    ) -> list[Inflight]:
        """Abort ``calls`` and wait (bounded) until the sent ones are back; return those still out
        when the wait gave up (none, normally).

        Held calls return ``aborted`` at the gate. ``send_abort(still_out, first)`` tells the
        server; with ``send_first=False`` the server has already been told (a pause) and only the
        calls still out after ABORT_RESEND_S get an abort of their own."""
        calls = list(calls)
        for call in calls:
            call.aborted.set()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        first = True
        while True:
            out = [c for c in calls if c.sent and not c.done.is_set()]
            if not out or not alive():
                return out
            if time.monotonic() >= deadline:
                logger.warning("%d aborted requests still out after %.1fs", len(out), DRAIN_TIMEOUT_S)
                return out
            if send_first or not first:
                await send_abort(out, first)
            first = False
            wait_s = min(ABORT_RESEND_S, max(0.0, deadline - time.monotonic()))
            done_waits = [asyncio.ensure_future(c.done.wait()) for c in out]
            try:
                await asyncio.wait(done_waits, timeout=wait_s)
            finally:
                for w in done_waits:
                    w.cancel()


__all__ = ["Inflight", "InflightTable", "DRAIN_TIMEOUT_S", "ABORT_RESEND_S"]
