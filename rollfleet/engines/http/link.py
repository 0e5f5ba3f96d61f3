"""The link from an engine to its server: the process it launched (or the ``base_url`` it attached
to), the client pair, and whether the server is alive.

One place answers "can this server still serve?", so every call fails the same way: the engine is
dead once the launched process has exited (a watcher notices within 0.2 s, a failed call within
:data:`~.process.EXIT_GRACE_S`) or the engine shut down, and every call then raises ``EngineDead``
with the reason, including a generation already waiting on the wire (:meth:`ServerLink.post`
races it against death). Calls use the transport-error rule of :mod:`.transport`.

Where a launched server listens (:class:`Endpoint`): a TCP port on the node's address, or, with
``private``, a Unix socket in its work dir (mode 0700), so that nothing but its replica can drive
it; its ``/metrics`` and ``/health`` are then served on TCP by a read-only exporter
(:mod:`.exporter`), whose URL is :meth:`ServerLink.public_url`.

A link serves one start: ``start`` after a death builds a new one, so nothing (events, sessions)
outlives the server it was made for.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

from rollfleet.engines.base import EngineHealth
from rollfleet.engines.http.exporter import ServerExporter
from rollfleet.engines.http.process import ServerProcess, ServerStartupError, free_port, wait_ready
from rollfleet.engines.http.transport import HTTPClients, StaleConnection, is_stale, transport_error
from rollfleet.errors import EngineDead, ReplicaUnavailable


@dataclass(frozen=True)
class Endpoint:
    """Where a launched server listens: ``port`` on ``host``, or the Unix socket ``path``."""

    host: str
    port: Optional[int] = None
    path: Optional[str] = None

    @property
    def url(self) -> str:
        """The base URL of requests (over a socket, only the Host header reads it)."""
        return f"http://{self.host}:{self.port}" if self.path is None else "http://localhost"


#: (command, environment) of the server for an endpoint.
SpawnArgs = Callable[[Endpoint], tuple[list[str], dict[str, str]]]


class ServerLink:
    def __init__(self, label: str, what: str, *, request_timeout_s: float, control_timeout_s: float,
                 ready_route: str = "/health", ready_probe_s: float = 2.0) -> None:  # fmt: skip
        self.label = label
        self.what = what  # "vLLM server", for messages
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.ready_route = ready_route
        self.ready_probe_s = ready_probe_s
        self.url = ""  # where the server is, for messages
        self.endpoint: Optional[Endpoint] = None  # where a launched server listens
        self.exporter: Optional[ServerExporter] = None  # its public face, when it listens privately
        self.server: Optional[ServerProcess] = None  # None when attached
        self.clients: Optional[HTTPClients] = None
        self.dead = asyncio.Event()  # set when the server died or the engine shut down
        self.dead_reason = ""

    # ------------------------------------------------------------------ liveness
    def alive(self) -> bool:
        if self.dead.is_set() or self.clients is None:
            return False
        return self.server is None or self.server.returncode is None

    def mark_dead(self, reason: str) -> None:
        if not self.dead.is_set():
            self.dead_reason = reason
            self.dead.set()

    def check(self) -> None:
        """Raise EngineDead when the server is known dead."""
        if self.server is not None and self.server.returncode is not None:
            self.mark_dead(self.server.exit_reason())
        if self.dead.is_set():
            raise EngineDead(self.label, self.dead_reason or f"{self.what} is dead")

    async def gone(self) -> Optional[str]:
        """Why the server is dead, giving a launched one a moment to show its exit; else None."""
        if not self.dead.is_set() and self.server is not None and await self.server.exited_within():
            self.mark_dead(self.server.exit_reason())
        return self.dead_reason if self.dead.is_set() else None

    # ------------------------------------------------------------------ up and down
    async def launch(self, host: str, spawn_args: SpawnArgs, timeout_s: float,
                     error: type[ServerStartupError], *, private: bool = False) -> None:  # fmt: skip
        """Spawn the server and wait until it is ready: on a free port of ``host``, or with
        ``private`` on a socket in its work dir, with the exporter on ``host``."""
        for attempt in (1, 2):  # a second try only if the picked port got taken meanwhile
            server = self.server = ServerProcess(self.label, self.what)  # its work dir is in the command
            endpoint = self.endpoint = (
                Endpoint(host, path=server.socket_path()) if private else Endpoint(host, port=free_port(host))
            )
            command, env = spawn_args(endpoint)
            server.spawn(command, env)
            await self._connect(endpoint.url, endpoint.path)
            try:
                await server.wait_ready(self.probe, timeout_s, error)
                break
            except ServerStartupError:
                if private or attempt == 2 or "address already in use" not in server.log_tail(200).lower():
                    raise
                await server.kill(0.0)
                server.remove_workdir()
        server.watch(self.mark_dead)
        if private:
            self.exporter = ServerExporter(self.label, self._fetch)
            await self.exporter.start(host)

    def public_url(self) -> Optional[str]:
        """Where others reach the server (its exporter when it listens privately), once launched."""
        if self.exporter is not None:
            return self.exporter.url
        return self.endpoint.url if self.endpoint is not None and self.endpoint.path is None else None

    async def _fetch(self, path: str, timeout: float) -> httpx.Response:
        if self.clients is None:
            raise RuntimeError("client closed")
        return await self.clients.request("GET", path, timeout=timeout)

    async def attach(self, url: str, timeout_s: float) -> None:
        """Reach a server someone else runs, and wait until it is ready."""
        await self._connect(url)
        await wait_ready(self.probe, timeout_s, self.label, f"{self.what} at {url}")

    async def _connect(self, url: str, uds: Optional[str] = None) -> None:
        if self.clients is not None:
            await self.clients.close()
        self.url = url if uds is None else f"unix:{uds}"  # for messages
        self.clients = HTTPClients(
            url, request_timeout_s=self.request_timeout_s, control_timeout_s=self.control_timeout_s, uds=uds
        )

    async def probe(self, remaining: float) -> Optional[str]:
        """Readiness: None when the server answers its ready route with 200, else what it did."""
        assert self.clients is not None
        path = self.ready_route
        try:
            resp = await self.clients.request("GET", path, timeout=max(0.1, min(remaining, self.ready_probe_s)))
        except (httpx.HTTPError, RuntimeError) as e:
            return f"{path}: {type(e).__name__}"
        return None if resp.status_code == 200 else f"{path} answered {resp.status_code}"

    async def health(self, timeout_s: float, busy_for: Optional[float], grace_s: float) -> EngineHealth:
        """``GET /health``. A server starved of CPU answers late while it still generates: busy is not
        dead. ``busy_for``: seconds since its last response while requests are out (None: none
        are); past ``grace_s`` of that, the silence counts (a hung server)."""
        assert self.clients is not None
        try:
            r = await self.clients.request("GET", "/health", timeout=timeout_s)
        except httpx.TimeoutException as e:
            if busy_for is not None and busy_for < grace_s:
                return EngineHealth(True, f"busy: /health slow ({e!r}), last response {busy_for:.1f}s ago")
            return EngineHealth(False, f"/health failed: {e!r}")
        except (httpx.HTTPError, RuntimeError) as e:
            return EngineHealth(False, f"/health failed: {e!r}")
        if r.status_code != 200:
            return EngineHealth(False, f"/health answered HTTP {r.status_code}")
        return EngineHealth(True, "ok")

    async def close(self, grace_s: float, keep_workdir: Callable[[Path], bool]) -> None:
        """Kill a launched server's whole process group (SIGTERM, SIGKILL after ``grace_s``) and
        close the clients; calls still out fail with the reason given to :meth:`mark_dead`."""
        self.mark_dead("engine shut down")
        if self.exporter is not None:
            await self.exporter.close()  # its URL stays readable: the address of the last server
        server, self.server = self.server, None  # never signal that group again: it may be reused
        if server is not None:
            await server.kill(grace_s)
            server.remove_workdir(keep=keep_workdir(server.workdir))
        clients, self.clients = self.clients, None
        if clients is not None:
            await clients.close()

    # ------------------------------------------------------------------ calls
    async def request(self, method: str, path: str, *, op: str, timeout: Optional[float] = None,
                      **kw: Any) -> httpx.Response:  # fmt: skip
        """A control call; transport errors become typed errors (HTTP error statuses do not)."""
        clients = self.clients
        if clients is None:
            raise ReplicaUnavailable(self.label, f"{op}: engine not started")
        for retry in (True, False):
            try:
                return await clients.request(method, path, timeout=timeout or self.control_timeout_s, **kw)
            except httpx.ConnectTimeout as e:
                # The call never reached the server (a loaded machine can starve a local connect
                # past its timeout): safe to send once more, whatever it was.
                if retry and await self.gone() is None:
                    continue
                raise await transport_error(op, e, self.label, self.url, self.gone) from e
            except (httpx.HTTPError, RuntimeError) as e:  # RuntimeError: client closed under us
                raise await transport_error(op, e, self.label, self.url, self.gone) from e
        raise AssertionError("unreachable")

    async def post(self, path: str, data: bytes, headers: dict[str, str], *, retry_stale: bool,
                   on_cancel: Callable[[], None]) -> tuple[int, bytes]:  # fmt: skip
        """POST one generation and return (status, body bytes), watching for the server's death.

        Raises StaleConnection (only with ``retry_stale``) when a reused connection turned out to be
        closed by the server, else the transport-error rule's error. ``on_cancel`` runs when the
        caller gives up (dropping the connection makes a server abort the request, but it notices
        only when it writes: the engine sends an explicit abort)."""
        assert self.clients is not None
        post = asyncio.ensure_future(self.clients.post(path, data, headers))
        dead = asyncio.ensure_future(self.dead.wait())
        try:
            await asyncio.wait({post, dead}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            post.cancel()
            on_cancel()
            raise
        finally:
            dead.cancel()
        if not post.done():
            post.cancel()
            raise EngineDead(self.label, self.dead_reason or f"{self.what} died")
        try:
            return post.result()
        except Exception as e:
            if retry_stale and is_stale(e) and self.alive():
                raise StaleConnection() from e
            raise await transport_error("generate", e, self.label, self.url, self.gone) from e


__all__ = ["ServerLink", "SpawnArgs", "Endpoint"]
