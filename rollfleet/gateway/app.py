"""``Gateway``: one gateway's parts (client, tokenizer, metrics, poller) and its ASGI app.

The gateway is built from a fleet *client* (the data path) and, optionally, an admin backend
(the manager: control plane, for ``/admin`` and the status poller). Nothing here starts Ray or a
fleet: :mod:`rollfleet.gateway.launch` does that for ``rollfleet serve``, and tests hand in the
client of a fleet they made. Every route goes through :meth:`Gateway.instrument`, which turns any
exception into the OpenAI error shape and counts the request, so no request leaves uncounted and
no traceback leaves as a 500 page.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Optional

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from rollfleet.client import LLMServerClient
from rollfleet.config import GatewayConfig, RolloutConfig
from rollfleet.gateway.codec import TextCodec
from rollfleet.gateway.errors import CLIENT_CLOSED_REQUEST, GatewayError, from_exception
from rollfleet.gateway.limits import GatewayLimits
from rollfleet.gateway.metrics import FleetCollector, GatewayMetrics, TrajectoryCollector
from rollfleet.gateway.poller import AdminBackend, FleetStatusPoller
from rollfleet.gateway.routes_admin import AdminRoutes
from rollfleet.gateway.routes_openai import OpenAIRoutes, ServedModel
from rollfleet.gateway.routes_sessions import SessionRoutes
from rollfleet.gateway.service import GenerationService
from rollfleet.gateway.sessions import SessionKeys
from rollfleet.gateway.trajectories import TrajectoryStore

logger = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]

_HTTP_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
}


class Gateway:
    """Everything one gateway serves. ``app`` is the ASGI application to run (uvicorn...).

    Args:
        client: the fleet client requests go through; a ``FullyAsyncLLMServerClient`` makes
            weight-update aborts invisible to callers.
        codec: the model's tokenizer (text routes, chat template, decoding).
        config: the ``gateway`` config section.
        rollout: the ``rollout`` section (model name, context length, default budget).
        admin: the control plane (``LLMServerManager``); ``None`` disables ``/admin`` and the
            fleet-health metrics.
        registry: where metrics live; a fresh ``CollectorRegistry`` by default (never the global one).
        on_membership_change: awaited after ``/admin`` adds or removes replicas (e.g. to rewrite
            the Prometheus scrape config).
    """

    def __init__(
        self,
        client: LLMServerClient,
        codec: TextCodec,
        *,
        config: Optional[GatewayConfig] = None,
        rollout: Optional[RolloutConfig] = None,
        admin: Optional[AdminBackend] = None,
        registry: Optional[CollectorRegistry] = None,
        on_membership_change: Optional[Callable[[], Awaitable[Any]]] = None,
    ) -> None:
        self.config = config or GatewayConfig()
        rollout = rollout or client.config
        self.codec = codec
        self.admin = admin
        self.on_membership_change = on_membership_change
        self.model_names: tuple[str, ...] = (self.config.served_model_name or rollout.model,)
        self.max_model_len: int = int(rollout.max_model_len or rollout.prompt_length + rollout.response_length)
        self.default_max_tokens: int = rollout.response_length
        self.created = int(time.time())
        self.metrics = GatewayMetrics(registry)
        self.poller = FleetStatusPoller(admin, self.config.status_poll_interval_s) if admin is not None else None
        self.metrics.registry.register(FleetCollector(client, self.poller))
        self.service = GenerationService(client, self.metrics, self.config.request_timeout_s)
        self.limits = GatewayLimits(self.config)
        self.session_keys = SessionKeys(self.config.session_secret, self.config.admin_token)
        #: Each session's exact tokens (None when ``gateway.capture_trajectories`` is off).
        self.trajectories: Optional[TrajectoryStore] = (
            TrajectoryStore(
                self.config.max_sessions, self.config.session_ttl_s, max_branches=self.config.max_session_branches
            )
            if self.config.capture_trajectories
            else None
        )
        self.metrics.registry.register(TrajectoryCollector(lambda: self.trajectories))
        self.app = self._build_app()

    # ------------------------------------------------------------------ app
    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
            if self.poller is not None:
                self.poller.start()
            try:
                yield
            finally:
                self.limits.close()
                if self.poller is not None:
                    await self.poller.stop()

        app = FastAPI(title="rollfleet gateway", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
        model = ServedModel(self.model_names, self.max_model_len, self.default_max_tokens, self.created)
        openai = OpenAIRoutes(
            self.service,
            self.codec,
            model,
            self.config,
            self.metrics.registry,
            self.instrument,
            self.limits,
            trajectories=self.trajectories,
            sessions=self.session_keys,
        )
        sessions = SessionRoutes(self.service, self.session_keys, self.limits, self.trajectories, self.instrument)
        app.router.routes.extend(openai.routes() + sessions.routes())
        if self.config.admin_token:
            if self.admin is None:
                raise ValueError("gateway.admin_token is set but there is no admin backend (the fleet's manager)")
            admin = AdminRoutes(
                self.admin,
                self.config.admin_token,
                instrument=self.instrument,
                gateway_status=self._gateway_status,
                limits=self.limits,
                on_membership_change=self.on_membership_change,
            )
            app.router.routes.extend(admin.routes())

        async def http_error(request: Request, exc: Exception) -> Response:
            status = getattr(exc, "status_code", 500)
            detail = getattr(exc, "detail", None) or "error"
            if status == 404:
                detail = f"no route {request.method} {request.url.path}"
            return GatewayError(
                status, str(detail), _HTTP_ERROR_TYPES.get(status, "server_error"), None, None
            ).response()

        app.add_exception_handler(StarletteHTTPException, http_error)
        app.state.gateway = self
        return app

    def _gateway_status(self) -> dict[str, Any]:
        """The gateway's own part of ``/admin/status``."""
        return {
            "model": self.model_names[0],
            "client": self.service.client.get_status(),
            "status_poll_errors": self.poller.errors if self.poller else None,
        }

    def instrument(self, route: str, handler: Endpoint) -> Endpoint:
        """Wrap a handler: OpenAI error shape for anything it raises, one count and one latency
        observation per request (labelled by the route template, not the raw path)."""
        observe = self.metrics.observe_request
        perf_counter = time.perf_counter

        async def endpoint(request: Request) -> Response:
            start = perf_counter()
            try:
                response = await handler(request)
            except Exception as exc:
                err = from_exception(exc)
                if err.status >= 500:
                    logger.warning("%s failed with %d: %s", route, err.status, err.message, exc_info=err.status == 500)
                headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
                response = err.response(headers)
            if isinstance(response, StreamingResponse):  # observed when its body is sent, not before
                response.body_iterator = _observed(response.body_iterator, response.status_code, route, start, observe)
            else:
                observe(route, response.status_code, perf_counter() - start)
            return response

        return endpoint


async def _observed(
    body: AsyncIterable[Any], status: int, route: str, start: float, observe: Callable[[str, int, float], None]
) -> AsyncIterator[Any]:
    """A streamed response's body, counted and timed when it ends: its handler returns before a
    token is sampled, and a latency taken then was the time to the headers (16 ms of a 2.8 s
    stream). A stream its client left is counted as 499, one that failed as 500 (an error the
    stream reports in-band keeps its status)."""
    try:
        async for chunk in body:
            yield chunk
    except (asyncio.CancelledError, GeneratorExit):
        status = CLIENT_CLOSED_REQUEST
        raise
    except Exception:
        status = 500
        raise
    finally:
        observe(route, status, time.perf_counter() - start)


__all__ = ["Gateway"]
