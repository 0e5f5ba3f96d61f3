"""Retry rules as named predicates and a bounded exponential backoff.

Which failures are worth another attempt is decided by type, never by message text: a replica
that died or is being restarted (``ReplicaUnavailable``, Ray's actor errors), a fleet with no
routable replica for a moment (``NoServerAvailable``), a timed-out attempt. Bad input
(``InvalidRequest``) is never retried: it fails the same way everywhere.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Optional

from rollfleet.config import RetryConfig
from rollfleet.errors import NoServerAvailable, ReplicaUnavailable, RollfleetError

try:
    from ray.exceptions import RayActorError, RayTaskError

    _ACTOR_ERRORS: tuple[type[BaseException], ...] = (RayActorError,)
    try:
        from ray.exceptions import ActorUnavailableError

        _ACTOR_ERRORS += (ActorUnavailableError,)
    except ImportError:  # pragma: no cover - older Ray
        pass
except ImportError:  # pragma: no cover
    RayTaskError = None  # type: ignore[assignment,misc]
    _ACTOR_ERRORS = ()


def unwrap(exc: BaseException) -> BaseException:
    """Ray wraps an actor's exception in ``RayTaskError``; give back our typed error inside."""
    if RayTaskError is not None and isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    return exc


def is_replica_failure(exc: BaseException) -> bool:
    """The replica (not the request) failed: quarantine it and try another."""
    return (
        isinstance(exc, ReplicaUnavailable) or isinstance(exc, _ACTOR_ERRORS) or isinstance(exc, asyncio.TimeoutError)
    )


def is_retryable(exc: BaseException) -> bool:
    if is_replica_failure(exc) or isinstance(exc, NoServerAvailable):
        return True
    return isinstance(exc, RollfleetError) and exc.retryable


class RetryPolicy:
    """Exponential backoff with jitter, capped, for at most ``max_attempts`` attempts."""

    def __init__(self, config: Optional[RetryConfig] = None, seed: Optional[int] = None) -> None:
        self.config = config or RetryConfig()
        self._rng = random.Random(seed)

    @property
    def max_attempts(self) -> int:
        return self.config.max_attempts

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (``attempt`` counts from 1)."""
        c = self.config
        # 2.0 ** 1024 overflows, and a wait for a routable replica counts more attempts than that
        # with a short max_backoff_s (a bare OverflowError): past what a float holds, the cap
        try:
            grow = c.multiplier ** max(0, attempt - 1)
        except OverflowError:
            grow = math.inf
        base = min(c.max_backoff_s, c.initial_backoff_s * grow)
        if c.jitter:
            base *= 1.0 + self._rng.uniform(-c.jitter, c.jitter)
        return max(0.0, base)

    async def wait(self, attempt: int) -> None:
        """Sleep the backoff; a zero one still yields to the loop (a retry loop that never awaited
        held the loop: no restart or probe ran, and a virtual clock never reached its deadline)."""
        await asyncio.sleep(self.backoff(attempt))


__all__ = ["RetryPolicy", "unwrap", "is_replica_failure", "is_retryable"]
