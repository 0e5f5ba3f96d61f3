"""Admin routes: fleet status, membership, weight updates from a path, profiling.

They exist only when ``gateway.admin_token`` is set (otherwise they are 404, not merely refused):
a gateway on a shared network must not let anyone push weights or remove replicas. Every call
needs ``Authorization: Bearer <admin_token>`` (401 without credentials, 403 with wrong ones;
compared in constant time). These are control-plane calls and go to the manager, never on the
data path.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rollfleet.gateway.errors import GatewayError
from rollfleet.gateway.limits import GatewayLimits
from rollfleet.gateway.protocol import AddReplicasRequest, ProfileRequest, RemoveReplicasRequest, UpdateWeightsRequest
from rollfleet.gateway.routes_openai import json_response, parse_body
from rollfleet.gateway.sessions import header_matches

if TYPE_CHECKING:  # pragma: no cover
    from rollfleet.gateway.poller import AdminBackend

logger = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


class AdminRoutes:
    """The admin handlers. They get the control plane (``admin``), the token, the gateway's own
    part of ``/admin/status`` (``gateway_status``), what to run after a membership change, the
    wrapper that counts requests and shapes errors, and the body limits (``limits``); only
    :mod:`rollfleet.gateway.app` knows every part."""

    def __init__(
        self,
        admin: "AdminBackend",
        token: str,
        *,
        instrument: Callable[[str, Handler], Handler],
        gateway_status: Callable[[], dict[str, Any]],
        limits: GatewayLimits,
        on_membership_change: Optional[Callable[[], Awaitable[Any]]] = None,
    ) -> None:
        if admin is None:
            raise ValueError("admin routes need an admin backend (the fleet's manager)")
        self.admin = admin
        self.limits = limits  # an admin body is read within the same size and time limits as any other
        self._token = token.encode()
        self.instrument = instrument
        self.gateway_status = gateway_status
        self.on_membership_change = on_membership_change

    def routes(self) -> list[Route]:
        wrap = self.instrument
        table: list[tuple[str, Handler, str]] = [
            ("/admin/status", self.status, "GET"),
            ("/admin/replicas", self.replicas, "GET"),
            ("/admin/replicas/add", self.add_replicas, "POST"),
            ("/admin/replicas/remove", self.remove_replicas, "POST"),
            ("/admin/update_weights", self.update_weights, "POST"),
            ("/admin/profile/start", self.start_profile, "POST"),
            ("/admin/profile/stop", self.stop_profile, "POST"),
        ]
        return [Route(path, wrap(path, self._guard(handler)), methods=[method]) for path, handler, method in table]

    def _guard(self, handler: Handler) -> Handler:
        async def guarded(request: Request) -> Response:
            self._authorize(request)
            return await handler(request)

        return guarded

    def _authorize(self, request: Request) -> None:
        header = request.headers.get("authorization")
        if not header:
            raise GatewayError(
                401,
                "admin routes need 'Authorization: Bearer <admin_token>'",
                "authentication_error",
                None,
                "missing_token",
            )
        scheme, _, credential = header.partition(" ")
        if scheme.lower() != "bearer" or not header_matches(credential, self._token):
            raise GatewayError(403, "the admin token is not valid", "permission_error", None, "invalid_token")

    # ------------------------------------------------------------------ handlers
    async def status(self, request: Request) -> Response:
        fleet = await self.admin.status()
        body = {"gateway": self.gateway_status(), "fleet": fleet.to_json()}
        return json_response(body)

    async def replicas(self, request: Request) -> Response:
        return json_response({"replicas": [r.to_json() for r in await self.admin.get_replicas()]})

    async def add_replicas(self, request: Request) -> Response:
        req = parse_body(AddReplicasRequest, await self.limits.read_body(request))
        added = await self.admin.add_replicas(req.num_replicas)
        body: dict[str, Any] = {"added": [r.to_json() for r in added]}
        await self._after_membership_change(body)
        return json_response(body)

    async def remove_replicas(self, request: Request) -> Response:
        req = parse_body(RemoveReplicasRequest, await self.limits.read_body(request))
        known = {r.replica_id for r in await self.admin.get_replicas()}
        unknown = [rid for rid in req.replica_ids if rid not in known]
        if unknown:
            raise GatewayError(
                404,
                f"unknown replica ids {unknown}; known: {sorted(known)}",
                "not_found_error",
                "replica_ids",
                "replica_not_found",
            )
        removed = await self.admin.remove_replicas(req.replica_ids, req.drain_timeout_s)
        body: dict[str, Any] = {"removed": list(removed)}
        await self._after_membership_change(body)
        return json_response(body)

    async def _after_membership_change(self, body: dict[str, Any]) -> None:
        """Refresh the scrape config (when one is kept) so Prometheus follows the fleet."""
        refresh = self.on_membership_change
        if refresh is None:
            return
        try:
            await refresh()
        except Exception as exc:  # the change itself succeeded; report the side effect's failure
            logger.warning("prometheus config refresh failed: %r", exc)
            body["prometheus_error"] = f"{type(exc).__name__}: {exc}"

    async def update_weights(self, request: Request) -> Response:
        req = parse_body(UpdateWeightsRequest, await self.limits.read_body(request))
        current = (await self.admin.status()).current_version
        if current is not None and req.version <= current:
            raise GatewayError(
                409,
                f"version must increase: {req.version} <= current {current}",
                "invalid_request_error",
                "version",
                "version_conflict",
            )
        result = await self.admin.update_weights(req.path, req.version, req.mode)
        return json_response(result)

    async def start_profile(self, request: Request) -> Response:
        body = await self.limits.read_body(request)
        kwargs = parse_body(ProfileRequest, body).model_dump() if body.strip() else {}
        await self.admin.start_profile(**kwargs)
        return json_response({"profiling": True})

    async def stop_profile(self, request: Request) -> Response:
        traces = await self.admin.stop_profile()
        return json_response({"profiling": False, "traces": traces})


__all__ = ["AdminRoutes"]
