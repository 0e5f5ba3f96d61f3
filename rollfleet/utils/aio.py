"""Small asyncio helpers."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Awaitable, Callable, Coroutine, Iterable, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


def auto_await(fn: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., Any]:
    """Let an async method be called from sync code too (as verl's ``auto_await`` does).

    Inside a running event loop the call returns the coroutine (``await manager.resume()``);
    outside one it runs it to completion (``manager.resume()`` in a script or a notebook cell).
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
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
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
