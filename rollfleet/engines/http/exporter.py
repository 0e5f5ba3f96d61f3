"""The public face of a server on a private socket: its ``/metrics`` and ``/health``, read-only, on TCP.

A launched server that listens on a Unix socket in its private work dir (:mod:`.link`) can be driven
by its replica only: its development routes (``/pause``, the weight routes, ``/collective_rpc``,
``/sleep``) are out of reach of other users on the node and of everything on the network. vLLM's
``--api-key`` would not do it: it guards ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, not the
control routes.

Prometheus still scrapes the server's metrics over TCP, and operators still look at its health: this
small aiohttp server, in the replica's process on the node's address, forwards ``GET /metrics`` and
``GET /health`` to the server (no body, no query, no headers passed on) and answers 404 to anything
else. Its URL is the engine's ``address()``.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Optional

import httpx
from aiohttp import web

#: What the exporter forwards; every other path is a 404, every other method a 405.
ROUTES = ("/metrics", "/health")
#: Bound of one forwarded call.
FORWARD_TIMEOUT_S = 10.0
#: Headers of the server's answer passed back.
PASSED_HEADERS = ("content-type",)

Fetch = Callable[[str, float], Awaitable[httpx.Response]]


class ServerExporter:
    """Serves ``ROUTES`` of one server on ``host``; ``fetch(path, timeout)`` reaches the server."""

    def __init__(self, label: str, fetch: Fetch) -> None:
        self.label = label
        self._fetch = fetch
        self._runner: Optional[web.AppRunner] = None
        self.url = ""

    async def start(self, host: str) -> str:
        """Listen on a free port of ``host``; return the URL."""
        app = web.Application(client_max_size=1024)  # nothing it serves takes a body
        for route in ROUTES:
            app.router.add_get(route, self._forward)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, 0).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        port = runner.addresses[0][1]
        self.url = f"http://{host}:{port}"
        return self.url

    async def _forward(self, request: web.Request) -> web.Response:
        try:
            resp = await self._fetch(request.path, FORWARD_TIMEOUT_S)
        except (httpx.HTTPError, RuntimeError) as e:  # RuntimeError: the server's client closed
            return web.Response(status=503, text=f"{self.label}: server unreachable ({type(e).__name__})\n")
        headers = {k: v for k, v in resp.headers.items() if k.lower() in PASSED_HEADERS}
        return web.Response(status=resp.status_code, body=resp.content, headers=headers)

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()


__all__ = ["ServerExporter", "ROUTES"]
