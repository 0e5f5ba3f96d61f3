"""A session's life over HTTP: its recorded trajectory, its reward, its end.

* ``GET /v1/sessions/{id}/trajectory``: the exact token ids, loss mask, logprobs and per-token
  weight versions of every branch (:mod:`rollfleet.gateway.trajectories`), and the reward;
* ``POST /v1/sessions/{id}/reward`` with ``{"reward": <finite number>}``;
* ``DELETE /v1/sessions/{id}``: ends it: its record and its sticky replica entry are freed.

All three take the session's key (``X-Rollfleet-Session-Key``, which every response of the session
carried) or the admin token: a session id is the caller's own string, and whoever guesses one must
not read, score or end someone else's trajectory.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rollfleet.gateway.errors import bad_request
from rollfleet.gateway.jsonio import dumps

if TYPE_CHECKING:  # pragma: no cover
    from rollfleet.gateway.limits import GatewayLimits
    from rollfleet.gateway.service import GenerationService
    from rollfleet.gateway.sessions import SessionKeys
    from rollfleet.gateway.trajectories import TrajectoryStore

Endpoint = Callable[[Request], Awaitable[Response]]


def _json(body: object, status: int = 200) -> Response:
    return Response(dumps(body), status_code=status, media_type="application/json")


class SessionRoutes:
    def __init__(
        self,
        service: "GenerationService",
        keys: "SessionKeys",
        limits: "GatewayLimits",
        store: Optional["TrajectoryStore"],
        instrument: Callable[[str, Endpoint], Endpoint],
    ) -> None:
        self.service = service
        self.keys = keys
        self.limits = limits
        self.store = store
        self.instrument = instrument

    def routes(self) -> list[Route]:
        wrap = self.instrument
        return [
            Route("/v1/sessions/{session_id:path}", wrap("/v1/sessions", self.finish), methods=["DELETE"]),
            Route(
                "/v1/sessions/{session_id:path}/trajectory",
                wrap("/v1/sessions/trajectory", self.trajectory),
                methods=["GET"],
            ),
            Route("/v1/sessions/{session_id:path}/reward", wrap("/v1/sessions/reward", self.reward), methods=["POST"]),
        ]

    def _session(self, request: Request) -> str:
        session_id = request.path_params["session_id"]
        self.limits.check_session_id(session_id, "session_id")
        self.keys.check(request, session_id)
        return session_id

    def _store(self) -> "TrajectoryStore":
        if self.store is None:
            raise bad_request(
                "session_id", "this gateway does not record trajectories (gateway.capture_trajectories is off)"
            )
        return self.store

    async def finish(self, request: Request) -> Response:
        session_id = self._session(request)
        recorded = self.store.end(session_id) if self.store is not None else False
        sticky = self.service.finish_session(session_id)
        self.keys.forget(session_id)
        return _json({"session_id": session_id, "finished": sticky or recorded, "trajectory_freed": recorded})

    async def trajectory(self, request: Request) -> Response:
        session_id = self._session(request)
        return _json(self._store().trajectory(session_id))

    async def reward(self, request: Request) -> Response:
        session_id = self._session(request)
        store = self._store()
        body = await self.limits.read_body(request)
        try:
            data = json.loads(body or b"null")
        except json.JSONDecodeError as exc:
            raise bad_request(None, f"the body is not JSON: {exc.msg}") from None
        except (ValueError, RecursionError):  # not UTF-8; nested past the parser's depth
            raise bad_request(None, "the body is not JSON: not UTF-8 text, or nested too deep") from None
        value = _finite(data.get("reward") if isinstance(data, dict) else None)
        if value is None:
            raise bad_request("reward", 'the body must be {"reward": <a finite number>}')
        store.set_reward(session_id, value)
        return _json({"session_id": session_id, "reward": value})


def _finite(value: Any) -> Optional[float]:
    """A JSON number as a finite float, else None (an integer of 400 digits overflows one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


__all__ = ["SessionRoutes"]
