"""The HTTP client pair an engine talks to its server with, and the one rule for transport errors.

Two clients, each where it is cheapest:

* ``aiohttp`` + orjson for the hot path (one POST per generation): at 64 requests in flight on a
  2-core machine httpx spent ~3.7 ms of CPU per completion and aiohttp ~0.2 ms, CPU that the server
  on the same cores would otherwise get (with httpx one replica process tops out near 270
  requests/s);
* ``httpx`` for the control routes (abort, pause, weights, health, metrics): rare, and its
  response object is handier.

Both drop idle connections after :data:`KEEPALIVE_S`, under the servers' own keep-alive (uvicorn's
default, and vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, is 5 s), so a request is never written into a
socket the server is closing. The race is not fully closed: the server may close a connection just
as a request goes out, and a server whose event loop was held up past its keep-alive (a starved
CPU, a long synchronous step) closes its idle connections as soon as it runs again, the requests
already waiting on them unread. So :func:`is_stale` names the errors that mean "the reused
connection was dead" on the generation path, :func:`is_unanswered` the control client's, and such
a request is sent once more on a fresh connection.

The transport-error rule (:func:`transport_error`), the same for every route and engine:

1. a timeout is ``ReplicaUnavailable``: a slow server is busy, not dead (restarting it would throw
   its in-flight work away);
2. a server whose process has exited (given :data:`~.process.EXIT_GRACE_S` to show it), or that the
   engine already knows dead, is ``EngineDead``;
3. a refused connection (nothing listens) is ``EngineDead`` too: a server we merely attached to
   (``base_url``) has no process to look at, and a refusal is its only sign of death;
4. anything else (a reset mid-response, a closed client during shutdown) is ``ReplicaUnavailable``.

``EngineDead`` tells the manager to restart the replica; both are retryable for the client.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Optional

import aiohttp
import httpx

from rollfleet.errors import EngineDead, ReplicaUnavailable

#: How long our idle connections are kept: under the servers' 5 s keep-alive.
KEEPALIVE_S = 2.0
#: Connect timeout of every call; a local server accepts at once unless its backlog is full.
CONNECT_TIMEOUT_S = 10.0


class StaleConnection(Exception):
    """A keep-alive connection was closed by the server as the request went out."""


def is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, (asyncio.TimeoutError, TimeoutError, httpx.TimeoutException))


def is_refused(exc: BaseException) -> bool:
    """Nothing accepted the connection (refused, unreachable): no server there."""
    return isinstance(exc, (httpx.ConnectError, aiohttp.ClientConnectorError)) and not is_timeout(exc)


def is_stale(exc: BaseException) -> bool:
    """A reused connection turned out to be closed by the server: worth one more try."""
    return (
        isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))
        and not is_refused(exc)
        and not is_timeout(exc)
    )


def is_unanswered(exc: BaseException) -> bool:
    """The server closed the connection before a byte of its answer: the control client's sign of
    a keep-alive connection closed under the request (a process that died meanwhile refuses the
    next connection, so a second try cannot run the request twice on it)."""
    return isinstance(exc, httpx.RemoteProtocolError) and "without sending a response" in str(exc)


async def transport_error(
    op: str, exc: BaseException, label: str, url: str, server_gone: Callable[[], Awaitable[Optional[str]]]
) -> ReplicaUnavailable:
    """The typed error for a failed call (see the module docstring for the rule).

    ``server_gone`` answers why the server is known dead (waiting briefly for a process to show
    its exit), or None."""
    if is_timeout(exc):
        return ReplicaUnavailable(label, f"{op}: timed out talking to {url} ({type(exc).__name__})")
    gone = await server_gone()
    if gone is not None:
        return EngineDead(label, f"{op}: {gone} ({exc!r})")
    if is_refused(exc):
        return EngineDead(label, f"{op}: cannot connect to {url} ({type(exc).__name__}: {exc})")
    return ReplicaUnavailable(label, f"{op}: HTTP error talking to {url}: {exc!r}")


class HTTPClients:
    """The aiohttp session (generation) and the httpx client (control routes) for one server, over
    TCP to ``base_url``, or over the Unix socket ``uds`` (``base_url`` then only names the host
    header)."""

    def __init__(
        self, base_url: str, *, request_timeout_s: float, control_timeout_s: float, uds: Optional[str] = None
    ) -> None:
        self.base_url = base_url
        connector: aiohttp.BaseConnector
        if uds is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        else:
            connector = aiohttp.UnixConnector(uds, limit=0, keepalive_timeout=KEEPALIVE_S)
        self.session = aiohttp.ClientSession(
            base_url=base_url,
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=CONNECT_TIMEOUT_S),
        )
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S)
        self.control = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(control_timeout_s, connect=CONNECT_TIMEOUT_S),
            transport=httpx.AsyncHTTPTransport(uds=uds, limits=limits),
            trust_env=False,  # a proxy from the environment must not sit between replica and server
        )

    async def post(self, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """POST on the hot path; (status, body bytes). Transport errors propagate untyped."""
        async with self.session.post(path, data=data, headers=headers) as resp:
            return resp.status, await resp.read()

    async def request(self, method: str, path: str, *, timeout: Optional[float] = None, **kw: Any) -> httpx.Response:
        """A control call; one that found its keep-alive connection closed under it
        (:func:`is_unanswered`) is sent once more (the pool has dropped that connection)."""
        if timeout is not None:
            kw["timeout"] = httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S))
        try:
            return await self.control.request(method, path, **kw)
        except httpx.RemoteProtocolError as e:
            if not is_unanswered(e):
                raise
        return await self.control.request(method, path, **kw)

    async def close(self) -> None:
        await self.session.close()
        await self.control.aclose()


__all__ = [
    "HTTPClients",
    "StaleConnection",
    "transport_error",
    "is_stale",
    "is_unanswered",
    "is_refused",
    "is_timeout",
    "KEEPALIVE_S",
    "CONNECT_TIMEOUT_S",
]
