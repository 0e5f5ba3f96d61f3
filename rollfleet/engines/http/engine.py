"""HTTPEngine: an engine that drives one inference server over HTTP, launched or attached.

Everything that does not depend on which server it is lives in this package, once: the server's
lifecycle (:mod:`.link`: launched as a supervised process, :mod:`.process`, or attached to with
``base_url``), the client pair and the transport-error rule (:mod:`.transport`), the in-flight
table with its pause gate and abort loop (:mod:`.inflight`), finish reasons and error bodies
(:mod:`.wire`), metrics (:mod:`.metrics`) and the vocabulary (:mod:`.vocab`). This class puts them
together as an :class:`~rollfleet.engines.base.Engine`: generate with the stale keep-alive retry,
abort/pause/resume, the busy-not-dead health grace, load caching and stats. A subclass says what is
different about its server, in two modules of its package and a few hooks:

* ``wire.py``: request bodies, response parsing, error-field extraction (no I/O);
* ``launch.py``: a mixin with ``_command()`` and ``_env()`` (flags, environment, devices);
* the engine class: the hooks below and the ops whose routes differ (weights, sleep, profile).

Hooks: ``_prepare`` (before the server is started or reached), ``_discover_limits``,
``_build_request``, ``_wire_id``, ``_generate_call``, ``_invalid``, ``_parse_output``,
``_abort_requests``, ``_pause_server``, ``_resume_server``, ``_server_load``; optional
``_ready_route``, ``_inflight_tokens``, ``_keep_workdir``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any, AsyncIterator, ClassVar, Coroutine, Mapping, Optional

import httpx

from rollfleet.engines.base import VERSIONS_UNKNOWN, Engine, EngineHealth, EngineLimits, EngineLoad
from rollfleet.engines.http.inflight import Inflight, InflightTable
from rollfleet.engines.http.link import Endpoint, ServerLink
from rollfleet.engines.http.metrics import named_stats, parse_metrics
from rollfleet.engines.http.process import ServerStartupError
from rollfleet.engines.http.transport import StaleConnection
from rollfleet.engines.http.wire import error_message
from rollfleet.errors import InvalidRequest, ReplicaUnavailable
from rollfleet.types import SamplingParams, TokenOutput

#: How long a server that answers /health too late still counts as healthy, if it is working on
#: requests and the last one came back at most this long ago (a CPU-starved server is slow, not
#: dead; restarting it would throw its in-flight work away).
BUSY_GRACE_S = 30.0
#: How long one /metrics scrape serves load() (the replica and the router poll it).
LOAD_CACHE_S = 0.05
#: Bounded shutdown of a server that is restarted after its death.
RESTART_GRACE_S = 2.0


class HTTPEngine(Engine):
    #: What the server is called in messages, e.g. ``"vLLM server"``.
    server_name: ClassVar[str] = "server"
    #: Raised when a launched server does not come up (an ``EngineDead``).
    startup_error: ClassVar[type[ServerStartupError]] = ServerStartupError
    #: Timeout of one readiness probe.
    ready_probe_s: ClassVar[float] = 2.0
    #: stats() keys (as the sim engine names them) -> the server's cumulative metric.
    stats_metrics: ClassVar[Mapping[str, str]] = {}

    def __init__(
        self, *, label: str, base_url: Optional[str], startup_timeout_s: float, request_timeout_s: float,
        control_timeout_s: float, health_timeout_s: float, private: bool = False,
    ) -> None:  # fmt: skip
        self.replica_label = label
        self.base_url = base_url.rstrip("/") if base_url else None  # set: attach, never launch
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.health_timeout_s = health_timeout_s
        self.private = private  # a launched server listens on a private socket (see .link)
        self.port: Optional[int] = None
        self.socket_path = None  # where a private server listens, once launched
        self._link = self._new_link()  # a new one per start
        self._limits: Optional[EngineLimits] = None
        self._started = False
        self._stopped = False  # shut down (not merely never started)
        self._table = InflightTable()
        self._background: set[asyncio.Task] = set()
        self._load_cache: Optional[tuple[float, EngineLoad]] = None
        self._last_metrics: dict[str, float] = {}
        self._counts = {"num_aborted": 0, "num_finished": 0, "num_errors": 0}
        self._last_progress = float("-inf")  # when the last response came back

    # ------------------------------------------------------------------ hooks
    def _command(self) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} launches no server")

    def _env(self) -> dict[str, str]:
        raise NotImplementedError(f"{type(self).__name__} launches no server")

    async def _prepare(self) -> None:
        """Before the server is launched or reached (e.g. resolve the model)."""

    @abc.abstractmethod
    async def _discover_limits(self) -> EngineLimits: ...

    @abc.abstractmethod
    def _build_request(
        self, prompt_ids: list[int], sampling_params: SamplingParams, extras: dict[str, Any]
    ) -> tuple[dict[str, Any], Optional[int]]:
        """(request body, token budget); raise InvalidRequest for what the server cannot take."""

    @abc.abstractmethod
    def _wire_id(self, request_id: str) -> str:
        """The id to send for ``request_id``, unique among the calls in flight (see ``_table``)."""

    @abc.abstractmethod
    def _generate_call(self, wire_id: str, body: dict[str, Any]) -> tuple[str, bytes, dict[str, str]]:
        """(path, body bytes, headers) of the generate POST."""

    @abc.abstractmethod
    def _invalid(self, message: str, param: Any, prompt_ids: list[int], body: dict[str, Any]) -> InvalidRequest: ...

    @abc.abstractmethod
    def _parse_output(self, raw: bytes, budget: Optional[int]) -> TokenOutput: ...

    @abc.abstractmethod
    def _abort_requests(self, wire_ids: list[str], everything: bool) -> list[tuple[str, dict[str, Any]]]:
        """(path, JSON body) of each POST that aborts ``wire_ids`` (``everything``: all of them)."""

    @abc.abstractmethod
    async def _pause_server(self) -> bool:
        """Pause the server; True when it aborted its requests itself, False when it cannot pause."""

    @abc.abstractmethod
    async def _resume_server(self) -> None: ...

    @abc.abstractmethod
    async def _server_load(self) -> EngineLoad: ...

    def _ready_route(self) -> str:
        return "/health"

    def _inflight_tokens(self, server_load: EngineLoad) -> int:
        return server_load.inflight_tokens

    def _keep_workdir(self, workdir: Path) -> bool:
        return False

    # ------------------------------------------------------------------ state
    def _new_link(self) -> ServerLink:
        return ServerLink(
            self.replica_label, self.server_name, request_timeout_s=self.request_timeout_s,
            control_timeout_s=self.control_timeout_s, ready_route=self._ready_route(), ready_probe_s=self.ready_probe_s,
        )  # fmt: skip

    @property
    def pid(self) -> Optional[int]:
        return self._link.server.pid if self._link.server is not None else None

    @property
    def workdir(self) -> Optional[Path]:
        return self._link.server.workdir if self._link.server is not None else None

    def address(self) -> str:
        """Where others reach the server: ``base_url``, its port, or the exporter of a private one."""
        return self.base_url or self._link.public_url() or f"{self.name}://not-started"

    def limits(self) -> EngineLimits:
        if self._limits is None:
            raise ReplicaUnavailable(self.replica_label, "engine not started: limits unknown")
        return self._limits

    def log_tail(self, lines: int = 60) -> str:
        return self._link.server.log_tail(lines) if self._link.server is not None else "(no log)"

    def is_alive(self) -> bool:
        return self._link.alive()

    def _check_alive(self) -> None:
        if not self._started:
            raise ReplicaUnavailable(self.replica_label, "engine shut down" if self._stopped else "engine not started")
        self._link.check()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._started and self.is_alive():
            return
        if self._link.server is not None or self._link.clients is not None:  # a restart after a death
            await self.shutdown(grace_s=RESTART_GRACE_S)
        self._link, self._stopped = self._new_link(), False
        self._table, self._load_cache = InflightTable(), None
        try:
            await self._prepare()
            if self.base_url is None:
                await self._link.launch(
                    self.bind_host, self._spawn_args, self.startup_timeout_s, self.startup_error, private=self.private
                )
            else:
                await self._link.attach(self.base_url, self.startup_timeout_s)
            self._limits = await self._discover_limits()
        except BaseException:  # cancelled or broken while starting: leave no server behind
            if self._link.server is not None:
                self._link.server.kill_now()
            await self.shutdown(grace_s=0.0)
            raise
        self._started = True

    def _spawn_args(self, endpoint: Endpoint) -> tuple[list[str], dict[str, str]]:
        self.port, self.socket_path = endpoint.port, endpoint.path
        return self._command(), self._env()

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Kill the launched server's whole process group (SIGTERM, SIGKILL after ``grace_s``), close
        the clients, fail what is in flight. Idempotent; ``start`` may be called again."""
        self._started, self._stopped = False, True
        await self._link.close(grace_s, self._keep_workdir)
        for task in list(self._background):
            task.cancel()

    # ------------------------------------------------------------------ data plane
    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams, **kwargs: Any
    ) -> TokenOutput:
        async with self._admitted(request_id, prompt_ids, sampling_params, kwargs) as (call, body, budget):
            return self._counted(await self._generate(call, body, prompt_ids, budget), call)

    @contextlib.asynccontextmanager
    async def _admitted(
        self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams, kwargs: dict[str, Any]
    ) -> AsyncIterator[tuple[Inflight, dict[str, Any], Optional[int]]]:
        """The path of every generation, whole or streamed: checks, the request body and budget, a
        row in the in-flight table, held there while paused or asleep; on the way out, however it
        ends, the row goes (no leaked in-flight count) and an error is counted."""
        self._check_alive()
        extras = {k: v for k, v in kwargs.items() if v is not None}
        body, budget = self._build_request(prompt_ids, sampling_params, extras)
        if not len(self._table):  # busy from now: the idle time before is not time the server spent busy
            self._last_progress = time.monotonic()  # (a fresh or long-idle engine read as past its grace at once)
        call = self._table.add(Inflight(request_id, self._wire_id(request_id), len(prompt_ids) + (budget or 0)))
        self._load_cache = None
        try:
            await self._table.wait_turn(call, self._link.dead)
            yield call, body, budget
        except (ReplicaUnavailable, InvalidRequest):
            self._counts["num_errors"] += 1
            raise
        finally:
            self._table.remove(call)
            self._load_cache = None

    def _counted(self, out: TokenOutput, call: Optional[Inflight] = None) -> TokenOutput:
        self._counts["num_aborted" if out.stop_reason == "aborted" else "num_finished"] += 1
        if call is not None and call.outlived_pause and out.token_versions is None:
            # Unlabelled by the server and still running when a pause gave up on it: a commit may
            # have loaded new weights under it. Told so, the replica labels its tokens unknown
            # rather than the version before (server.attempts.stamp_versions).
            out.extra_fields[VERSIONS_UNKNOWN] = True
        return out

    async def _generate(
        self, call: Inflight, body: dict[str, Any], prompt_ids: list[int], budget: Optional[int]
    ) -> TokenOutput:
        if call.aborted.is_set():
            return TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted")
        self._check_alive()
        call.sent = True
        try:
            status, raw = await self._send(call, body, retry_stale=True)
        except StaleConnection:
            # The server closed an idle keep-alive connection just as we reused it. Send once more
            # on a fresh connection, under a new id in case the first one was read after all.
            self._abort_in_background([call.wire_id])
            if call.aborted.is_set():
                return TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted")
            self._table.rename(call, self._wire_id(call.request_id))  # a fresh one: no prefix of the other
            status, raw = await self._send(call, body, retry_stale=False)
        self._last_progress = time.monotonic()
        if status in (400, 422):
            raise self._invalid(*error_message(status, raw), prompt_ids, body)
        if status >= 400:
            message = error_message(status, raw)[0][:1000]
            raise ReplicaUnavailable(
                self.replica_label, f"generate: {self.server_name} answered HTTP {status}: {message}"
            )
        try:
            return self._parse_output(raw, budget)
        except InvalidRequest:
            raise
        except (ValueError, LookupError, TypeError) as e:
            raise ReplicaUnavailable(self.replica_label, f"generate: unexpected response {raw[:200]!r} ({e!r})") from e

    async def _send(self, call: Inflight, body: dict[str, Any], retry_stale: bool) -> tuple[int, bytes]:
        path, data, headers = self._generate_call(call.wire_id, body)
        return await self._link.post(
            path, data, headers, retry_stale=retry_stale, on_cancel=lambda: self._abort_in_background([call.wire_id])
        )

    # ------------------------------------------------------------------ aborts and holds
    async def abort(self, request_id: str) -> None:
        await self._abort(self._table.of(request_id), everything=False)

    async def abort_all(self) -> int:
        calls = self._table.calls()
        await self._abort(calls, everything=True)
        return len(calls)

    async def _abort(self, calls: list[Inflight], everything: bool, told: bool = False) -> list[Inflight]:
        """Abort ``calls``; return those still out when the wait for them gave up."""

        async def send(out: list[Inflight], first: bool) -> None:
            await self._send_abort([c.wire_id for c in out], everything and first)

        if not calls:
            return []
        return await self._table.drain(calls, send, self.is_alive, send_first=not told)

    async def _send_abort(self, wire_ids: list[str], everything: bool = False) -> None:
        posts = [
            self._control("POST", path, op="abort", json=body)
            for path, body in self._abort_requests(wire_ids, everything)
        ]
        await asyncio.gather(*posts)

    def _abort_in_background(self, wire_ids: list[str]) -> None:
        """Best effort: a server that is gone or busy has nothing left to free."""

        async def quietly() -> None:
            try:
                await self._send_abort(wire_ids)
            except ReplicaUnavailable:
                pass

        if self.is_alive():
            self._in_background(quietly())

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background, owned by this engine (cancelled at shutdown)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def pause(self) -> None:
        """Hold new requests here and abort the ones in flight; return once they are back (they
        return ``aborted`` with their partial tokens). The server is paused too, so a request
        already on the wire does not slip through: it is queued there, and aborted again."""
        self._table.hold("pause")
        sent = self._table.sent()  # nothing new is sent once the gate is closed
        told = await self._pause_server()
        for call in await self._abort(sent, everything=True, told=told):
            call.outlived_pause = True  # a load may follow: its tokens' weights are unknown

    async def resume(self) -> None:
        await self._resume_server()
        self._release("pause")

    def _release(self, hold: str) -> None:
        """Let the requests held by ``hold`` go; busy time starts again from now (the pause, a
        sleep or a commit, was no time the server spent on them: past the grace, the first slow
        /health after a long sync marked it dead)."""
        self._last_progress = time.monotonic()
        self._table.release(hold)

    # ------------------------------------------------------------------ control plane
    async def _request(self, method: str, path: str, *, op: str, **kw: Any) -> httpx.Response:
        return await self._link.request(method, path, op=op, **kw)  # also while starting; no status check

    async def _control(self, method: str, path: str, *, op: str, ok: bool = True, **kw: Any) -> httpx.Response:
        """A control call on a live engine; with ``ok``, an HTTP error status raises too."""
        self._check_alive()
        resp = await self._request(method, path, op=op, **kw)
        if ok:
            self._raise_for(resp, op)
        return resp

    def _raise_for(self, resp: httpx.Response, op: str) -> None:
        if resp.status_code >= 400:
            message = error_message(resp.status_code, resp.content)[0][:500]
            raise ReplicaUnavailable(
                self.replica_label, f"{op}: {self.server_name} answered HTTP {resp.status_code}: {message}"
            )

    async def health(self) -> EngineHealth:
        try:
            self._check_alive()
        except ReplicaUnavailable as e:
            return EngineHealth(False, e.reason)
        busy_for = time.monotonic() - self._last_progress if len(self._table) else None
        return await self._link.health(self.health_timeout_s, busy_for, BUSY_GRACE_S)

    async def load(self) -> EngineLoad:
        """The server's view (cached for LOAD_CACHE_S), plus the calls this engine holds."""
        now = time.monotonic()
        cached = self._load_cache
        if cached is None or now - cached[0] >= LOAD_CACHE_S:
            cached = self._load_cache = (now, await self._server_load())
        srv = cached[1]
        return EngineLoad(srv.running, srv.waiting + self._table.held(), self._inflight_tokens(srv), srv.kv_usage)

    async def metrics(self) -> dict[str, float]:
        """The server's own metrics (sums over label sets), e.g. ``vllm:prefix_cache_hits_total``."""
        resp = await self._control("GET", "/metrics", op="metrics", timeout=self.health_timeout_s)
        self._last_metrics = parse_metrics(resp.text)
        return self._last_metrics

    def stats(self) -> dict[str, float]:
        """Cumulative counters, named as the sim engine names them, from the last ``/metrics``
        scrape (refreshed by :meth:`load` and :meth:`metrics`) plus this engine's own counts."""
        out = named_stats(self._last_metrics, dict(self.stats_metrics))
        out.update({k: float(v) for k, v in self._counts.items()})
        if self.pid is not None:
            out[f"{self.name}_pid"] = float(self.pid)  # the server's process group, for operators and fault tests
        return out


__all__ = ["HTTPEngine", "BUSY_GRACE_S", "LOAD_CACHE_S"]
