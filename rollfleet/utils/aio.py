"""Small asyncio helpers."""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable, Coroutine, TypeVar

T = TypeVar("T")


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
