"""Small asyncio helpers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import threading
from typing import Any, Awaitable, Callable, Coroutine, Iterable, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


def auto_await(fn: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., Any]:
    """Let an async method be called from sync code too (as verl's ``auto_await`` does).

    Inside a running event loop the call returns the coroutine (``await manager.resume()``, as in
    a notebook cell, which runs in one); outside one it runs it to completion (``manager.resume()``
    in a script).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        coro = fn(*args, **kwargs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        return coro

    return wrapper


async def gather_or_cancel(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Every call's result, in order; when one fails (or the caller is cancelled), the others are
    cancelled and waited for before the error goes on. ``asyncio.gather`` leaves them running: the
    rest of a failed GRPO group or ``n``-choice request would go on generating on the fleet, unseen,
    while the caller retries or has given up."""
    tasks: list[asyncio.Future[T]] = []
    try:
        for call in calls:  # one at a time: calls the iterable raised after are cancelled too
            tasks.append(asyncio.ensure_future(call))
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def run_to_end(work: Awaitable[T], what: str, outcome: Callable[[T], str]) -> T:
    """``work``'s result; a caller that gives up (cancelled, timed out) does not stop it: it runs
    to its end, which goes to the log (``what`` ... ``outcome(result)``). For control operations
    that, stopped half-way, would leave the fleet in a state nobody knows of."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(functools.partial(_log_outcome, what, outcome))
        raise


def _log_outcome(what: str, outcome: Callable[[Any], str], task: "asyncio.Future[Any]") -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.error("%s whose caller gave up failed: %r", what, exc)
    else:
        logger.info("%s whose caller gave up %s", what, outcome(task.result()))


class ThreadPerCall(concurrent.futures.Executor):
    """An executor that runs every call on a thread of its own, started at once (a daemon).

    For calls that may hang for good (a user's synchronous tool whose backend is gone): a call
    that times out keeps its thread, and no Python thread can be stopped. On a pool (the loop's
    default one has 6 threads on 2 cores) a few hung calls took every thread, and each later call
    waited for one until its own timeout, reported as timed out without having run (and ran
    later, after the model was told it had not). Here a hung call costs its own thread only, and
    a daemon thread does not hold up the interpreter's exit. Use it through
    ``loop.run_in_executor``, so that a virtual-time loop knows a thread is working."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> "concurrent.futures.Future[T]":
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        context = contextvars.copy_context()  # as asyncio.to_thread does

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = context.run(fn, *args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

        threading.Thread(target=run, name="rollfleet-call", daemon=True).start()
        return future
