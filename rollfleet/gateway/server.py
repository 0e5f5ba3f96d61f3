"""Run an ASGI app with uvicorn *inside the caller's event loop*.

Why in-loop and not ``uvicorn.run``: the gateway's fleet client keeps its fleet view refreshed by a
task on the loop it runs in, and Ray's awaitables resolve on whatever loop awaits them, so the
gateway, the client and (in tests) the test itself share one loop and nothing crosses threads.
Signals are left to the owner (``rollfleet serve`` installs its own SIGINT/SIGTERM handlers and
shuts the fleet down after the server), so uvicorn's own signal capture is switched off.

httptools (HTTP parsing in C) is used when installed; port 0 picks a free port, readable from
:attr:`GatewayServer.port` once started.

Slow clients: a connection whose first request line and headers are not complete within
``header_timeout_s`` is closed (uvicorn itself waits forever for them, so a few thousand
half-open connections would pin the gateway); ``max_connections`` becomes uvicorn's
``limit_concurrency`` (503 past it). Bodies have their own deadline (:mod:`rollfleet.gateway.limits`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib.util
import socket
from typing import Any, Iterator, Optional

import uvicorn

from rollfleet.errors import CannotListen

#: How long start() waits for uvicorn to bind and finish the app's lifespan start-up.
STARTUP_TIMEOUT_S = 30.0


class _InLoopServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the owner handles signals
        yield


def _with_header_deadline(protocol: type, header_timeout_s: float) -> type:
    """uvicorn's HTTP protocol class, closing connections that send no complete request headers
    within ``header_timeout_s`` of a request's first byte: the connection's first request, and each
    one after it on a kept-alive connection (a new ``cycle`` exists once a request's headers are
    in). Timed from the connection alone, one good request bought a connection that then sent
    half a request line with no deadline at all."""

    class HeaderDeadline(protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._armed_after: Any = None  # the request whose successor's headers are awaited
            self._header_deadline = self.loop.call_later(header_timeout_s, self._headers_late)

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if cycle is not None and cycle.response_complete and self._armed_after is not cycle:
                self._header_deadline.cancel()  # the next request begins: its headers get the deadline too
                self._armed_after = cycle
                self._header_deadline = self.loop.call_later(header_timeout_s, self._headers_late)
            super().data_received(data)

        def _headers_late(self) -> None:
            transport = getattr(self, "transport", None)
            if self.cycle is self._armed_after and transport is not None and not transport.is_closing():
                transport.close()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            deadline = getattr(self, "_header_deadline", None)
            if deadline is not None:
                deadline.cancel()
            super().connection_lost(exc)

    return HeaderDeadline


def check_can_listen(host: str, port: int) -> None:
    """Raise :class:`~rollfleet.errors.CannotListen` when ``host:port`` cannot be bound now, before
    anything costly starts (``rollfleet serve`` starts Ray and the fleet before its gateway, and a
    taken port then ended that start-up in a traceback). Port 0 always binds. Bound as uvicorn
    binds (``SO_REUSEADDR``: a port only in TIME_WAIT is free) and let go at once."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CannotListen("gateway.host", f"{host}:{port}", str(exc)) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            # an address not this machine's is the host's fault; taken, or privileged, the port's
            field = "gateway.host" if exc.errno == errno.EADDRNOTAVAIL else "gateway.port"
            raise CannotListen(field, f"{host}:{port}", exc.strerror or str(exc)) from None


class GatewayServer:
    """A uvicorn server as an asyncio task: ``await start()``, ``url``, ``await stop()``."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        access_log: bool = False,
        log_level: str = "warning",
        graceful_shutdown_s: int = 10,
        header_timeout_s: float = 10.0,
        max_connections: Optional[int] = None,
    ) -> None:
        if importlib.util.find_spec("httptools") is not None:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as protocol
        else:
            from uvicorn.protocols.http.h11_impl import H11Protocol as protocol  # type: ignore[assignment]
        self.config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=_with_header_deadline(protocol, header_timeout_s),
            limit_concurrency=max_connections,
            lifespan="on",
            access_log=access_log,
            log_level=log_level,
            timeout_keep_alive=60,
            backlog=4096,
            timeout_graceful_shutdown=graceful_shutdown_s,
        )
        self.server = _InLoopServer(self.config)
        self.host = host
        self.port: Optional[int] = None
        self._task: Optional[asyncio.Task[None]] = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    async def start(self) -> "GatewayServer":
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="rollfleet-gateway-uvicorn")
        deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises the start-up error
                raise RuntimeError(f"the gateway did not start on {self.host}:{self.config.port} (see the log above)")
            if asyncio.get_running_loop().time() > deadline:
                await self.stop()
                raise TimeoutError(f"the gateway did not start within {STARTUP_TIMEOUT_S} s")
            await asyncio.sleep(0.005)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    async def _serve(self) -> None:
        try:
            await self.server.serve()
        except SystemExit as exc:  # uvicorn exits the process on a bind error; turn it into an error
            raise RuntimeError(f"the gateway could not start on {self.host}:{self.config.port}") from exc

    async def stop(self) -> None:
        """Stop accepting, finish in-flight requests, run the lifespan shutdown."""
        task, self._task = self._task, None
        if task is None:
            return
        self.server.should_exit = True
        try:
            await task
        except Exception:
            pass


__all__ = ["GatewayServer", "STARTUP_TIMEOUT_S", "check_can_listen"]
