"""Awaiting and cancelling one call on a replica handle: a Ray ``ObjectRef``, or the future of an
in-process handle (:class:`~rollfleet.server.local.LocalHandle`)."""

from __future__ import annotations

import asyncio
from typing import Any, Optional


async def awaited(ref: Any) -> Any:
    """The call as a coroutine: one task shape (``wait_for``, ``ensure_future``, cancellation)
    whatever the handle returned."""
    return await ref


def cancel(ref: Any) -> None:
    """Stop the replica's side of a call its caller gave up on: its request would otherwise run to
    its end and hold a batch slot for nobody."""
    if isinstance(ref, asyncio.Future):  # an in-process handle (tests, local fleets)
        ref.cancel()
        return
    try:
        import ray

        ray.cancel(ref)
    except Exception:  # already finished, or not a Ray ref
        pass


async def within(ref: Any, timeout_s: Optional[float]) -> Any:
    """The call's result, waited for at most ``timeout_s`` (None: no limit); a caller that leaves
    or runs out of time cancels the replica's side too (``asyncio.TimeoutError`` then)."""
    try:
        return await (ref if timeout_s is None else asyncio.wait_for(awaited(ref), timeout_s))
    except (asyncio.CancelledError, asyncio.TimeoutError):
        cancel(ref)
        raise


__all__ = ["awaited", "cancel", "within"]
