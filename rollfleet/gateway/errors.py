"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every failure leaves the gateway in this one shape, decided by the *type* of the exception (never
its text), so an OpenAI client raises the matching exception class (``BadRequestError``,
``NotFoundError``, ``AuthenticationError``...) and an RL agent can tell its own mistakes (4xx,
``param`` names the field) from the fleet's (5xx, worth a retry).

| cause                                             | status | type                        |
|---------------------------------------------------|--------|-----------------------------|
| request body fails validation (pydantic)          | 400    | invalid_request_error       |
| ``InvalidRequest`` from a replica, ``NotSupported``| 400    | invalid_request_error       |
| unknown model / route                             | 404    | not_found_error             |
| missing / wrong admin token                       | 401/403| authentication/permission   |
| ``NoServerAvailable``, replicas failing           | 503    | service_unavailable_error   |
| the request ran past ``request_timeout_s``        | 504    | timeout_error               |
| anything else                                     | 500    | server_error                |
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional, Sequence

from pydantic import ValidationError
from starlette.responses import Response

from rollfleet.errors import InvalidRequest, NoServerAvailable, NotSupported, ReplicaUnavailable, RetriesExhausted
from rollfleet.gateway.jsonio import dumps

#: Maps a fleet field name (``prompt_ids[3]``, ``sampling_params.max_tokens``) to the name the
#: caller used in its request body (``prompt``, ``max_tokens``).
FieldMap = Callable[[str], str]

#: Union members and validators appear in pydantic's error locations as tags; they are not fields.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


class GatewayError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: Optional[dict[str, str]] = None) -> Response:
        return Response(dumps(self.body()), status_code=self.status, media_type="application/json", headers=headers)


def bad_request(param: Optional[str], message: str, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", param, code)


#: nginx's status for a request whose client closed the connection before the answer (it reaches
#: nobody; it is what the request counts as in the gateway's metrics).
CLIENT_CLOSED_REQUEST = 499


def client_gone() -> GatewayError:
    return GatewayError(
        CLIENT_CLOSED_REQUEST, "the client closed the connection before the answer", code="client_disconnected"
    )


def model_not_found(model: str, served: Sequence[str]) -> GatewayError:
    return GatewayError(
        404,
        f"The model '{model}' does not exist; this gateway serves {list(served)}",
        "not_found_error",
        "model",
        "model_not_found",
    )


def _loc_to_param(loc: Sequence[Any]) -> Optional[str]:
    """``("messages", 0, "content")`` -> ``messages[0].content``; union/validator tags dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        text = str(part)
        if text.lower() in _TYPE_TAGS or any(c in text for c in "[](),|-"):
            break  # a union member or validator tag: the field path ended before it
        out = f"{out}.{text}" if out else text
    return out or None


def from_validation_error(exc: ValidationError) -> GatewayError:
    """400 naming the first offending field; the message lists every problem."""
    errors = exc.errors(include_url=False, include_input=False)
    if not errors:
        return bad_request(None, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return GatewayError(400, f"request body is not valid JSON: {first.get('msg')}", param=None, code="invalid_json")
    param = _loc_to_param(first.get("loc", ()))
    seen: list[str] = []
    for err in errors:
        p = _loc_to_param(err.get("loc", ())) or "body"
        line = f"{p}: {err.get('msg')}"
        if line not in seen:
            seen.append(line)
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    return GatewayError(400, "invalid request: " + "; ".join(seen[:8]), "invalid_request_error", param, code)


def _identity(name: str) -> str:
    return name


def from_exception(exc: BaseException, field_map: FieldMap = _identity) -> GatewayError:
    """The OpenAI error for anything raised while serving a request."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, RetriesExhausted) and exc.last_error is not None:
        inner = from_exception(exc.last_error, field_map)
        if inner.status >= 500:
            inner.message = f"{exc}"
        return inner
    if isinstance(exc, InvalidRequest):
        return GatewayError(400, str(exc), "invalid_request_error", field_map(exc.field), "invalid_value")
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, NotSupported):
        return GatewayError(400, str(exc), "invalid_request_error", None, "not_supported")
    if isinstance(exc, (NoServerAvailable, ReplicaUnavailable)):
        return GatewayError(503, str(exc), "service_unavailable_error", None, "no_replica_available")
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return GatewayError(
            504, "the fleet did not answer within the request timeout", "timeout_error", None, "timeout"
        )
    return GatewayError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")


__all__ = [
    "GatewayError",
    "FieldMap",
    "CLIENT_CLOSED_REQUEST",
    "bad_request",
    "client_gone",
    "model_not_found",
    "from_validation_error",
    "from_exception",
]
