"""An in-process handle with the same call shape as a Ray actor handle (``h.method.remote(...)``).

Lets the client, the balancer and the agent layers run against plain :class:`Replica` objects in
one event loop: unit tests without Ray, and single-process tools.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any


class _LocalMethod:
    __slots__ = ("_fn",)

    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> "asyncio.Future[Any]":
        result = self._fn(*args, **kwargs)
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.set_result(result)
        return fut


class LocalHandle:
    """Wraps an object so that ``handle.method.remote(...)`` returns an awaitable, like Ray."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._target, name))

    @property
    def target(self) -> Any:
        return self._target

    def stream_generate(self, *args: Any, **kwargs: Any) -> Any:
        """The target's ``generate_stream`` (an async iterator, not a call to await)."""
        return self._target.generate_stream(*args, **kwargs)


__all__ = ["LocalHandle"]
