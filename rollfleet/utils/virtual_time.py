"""Virtual time for asyncio: an event loop whose clock jumps to the next timer instead of waiting.

Why: a simulation of a fleet (the sim engine pacing its steps with ``asyncio.sleep``, the client
retrying with backoff, a learner "training" for a while) should give the same answer on any host
and as fast as the host can compute it. Wall-clock pacing ties the results to the host's speed
and load (a step that should take 7 ms of simulated time takes longer on a loaded machine, and
every ratio computed from it moves). On this loop, ``loop.time()`` is a virtual clock that only
moves when every task is blocked on a timer: it then jumps to the earliest one. The code that runs
on it is the real code (policies, stickiness, resumes), unchanged: anything written against
``loop.time()``, ``asyncio.sleep``, ``asyncio.wait_for`` and ``asyncio.timeout`` runs in virtual
time. The ready queue is FIFO, so a run is deterministic given its seeds.

What it cannot make virtual: ``time.monotonic()`` and ``time.time()`` read directly (they keep
reading the host's clock, so they may only measure, never decide: :func:`now` is the clock to
decide by), and real I/O or threads (the loop waits for them for real when nothing else is
scheduled; a task waiting on nothing at all would wait forever, so :func:`run` gives up after
``idle_timeout_s`` of real time with nothing to do). A thread's work (``run_in_executor``,
``asyncio.to_thread``) takes no virtual time: while one runs, the clock does not jump, or a
timeout around it would fire at once and periodic timers would race ahead for as long as it
ran. Only a thread still running after ``idle_timeout_s`` of real time lets the clock go on
(so that a timeout around a hung one fires), and is not waited for again: a thread left running
on purpose (a timed-out tool call that cannot be stopped) must not cost every later jump that wait.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from typing import Any, Callable, Coroutine, Optional, TypeVar

T = TypeVar("T")


class Stalled(RuntimeError):
    """Every task waits, but on nothing that a clock jump can bring (no timer is scheduled)."""


#: While callbacks are ready, real file descriptors are polled once in this many loop iterations.
BUSY_POLL_EVERY = 64


class _JumpingSelector(selectors.DefaultSelector):
    """Polls real file descriptors without blocking; when the loop would block until its next
    timer (``timeout``) and nothing real is ready, advances the loop's virtual clock instead.

    While callbacks are ready (``timeout == 0``) it polls only every :data:`BUSY_POLL_EVERY`-th
    time: a plan runs hundreds of thousands of loop iterations with no real I/O at all, and a poll
    each (a system call) was 5% of its wall time. Real I/O waits at most that many iterations,
    a few milliseconds of wall time at most; it cannot change what a run
    computes, as its timing was never deterministic."""

    def __init__(self, idle_timeout_s: float) -> None:
        super().__init__()
        self.loop: Optional["VirtualTimeLoop"] = None
        self.idle_timeout_s = idle_timeout_s
        self._busy_skips = 0

    def select(self, timeout: Optional[float] = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout == 0:
            self._busy_skips += 1
            if self._busy_skips < BUSY_POLL_EVERY:
                return []
        self._busy_skips = 0
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # no timer at all: only real I/O (a thread's result) can wake the loop
            events = super().select(self.idle_timeout_s)
            if not events:
                running = self.loop.threads_running if self.loop is not None else 0
                if running:  # not nothing to do: threads that outlived the wait (a timer would go on)
                    raise Stalled(
                        f"{running} executor call(s) still running after {self.idle_timeout_s} s, and no task or "
                        "timer to run meanwhile (raise the idle timeout for slow threads)"
                    )
                raise Stalled(f"no task can run and no timer is scheduled (waited {self.idle_timeout_s} s for I/O)")
            return events
        assert self.loop is not None
        if self.loop.threads_running:  # its result comes as real I/O (the loop's self-pipe)
            events = super().select(self.idle_timeout_s)
            if events:
                return events
            self.loop.give_up_on_threads()  # hung, or left running: the clock goes on without them
        self.loop.advance(timeout)
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on a virtual clock (seconds from 0); see the module docstring."""

    def __init__(self, idle_timeout_s: float = 30.0) -> None:
        selector = _JumpingSelector(idle_timeout_s)
        self._virtual_now = 0.0
        #: Executor calls not yet done that the clock waits for (see the module docstring). A set,
        #: not a count: a call given up on that ends later must not uncount one started since.
        self._threads: set[asyncio.Future[Any]] = set()
        super().__init__(selector)
        selector.loop = self

    def time(self) -> float:
        return self._virtual_now

    @property
    def threads_running(self) -> int:
        return len(self._threads)

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> "asyncio.Future[T]":  # type: ignore[override]
        future: "asyncio.Future[T]" = super().run_in_executor(executor, func, *args)
        self._threads.add(future)
        future.add_done_callback(self._threads.discard)
        return future

    def give_up_on_threads(self) -> None:
        """Stop waiting for the executor calls running now (hung, or left running on purpose)."""
        self._threads.clear()

    def advance(self, seconds: float) -> None:
        self._virtual_now += max(0.0, seconds)


def now() -> float:
    """The running loop's clock (virtual on a :class:`VirtualTimeLoop`), else the host's monotonic
    clock. Code that decides by time (a deadline, an age, a quarantine's end) reads this, so that
    on a virtual-time loop it decides as the simulated run would, not as fast as the host ran it."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


def run(coro: Coroutine[Any, Any, T], *, idle_timeout_s: float = 30.0) -> T:
    """``asyncio.run`` on a :class:`VirtualTimeLoop`: run ``coro`` to completion in virtual time."""
    loop = VirtualTimeLoop(idle_timeout_s)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


__all__ = ["VirtualTimeLoop", "Stalled", "BUSY_POLL_EVERY", "now", "run"]
