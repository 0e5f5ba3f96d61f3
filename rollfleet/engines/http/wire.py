"""Wire rules every HTTP engine shares (pure: no I/O): finish reasons and error bodies.

**Finish reasons.** Each server names why a generation ended in its own words (vLLM a string in
``choices[0].finish_reason``, SGLang ``meta_info.finish_reason.type``); :func:`stop_reason` maps
them to rollfleet's one vocabulary (``rollfleet.types.StopReason``) with one table:

* ``stop`` -> ``stop``, ``length`` -> ``length``, ``abort`` -> ``aborted``;
* ``repetition`` (vLLM's repetition detection, asked for in the sampling parameters) -> ``stop``: the
  server ended the response on purpose and resuming it would only repeat;
* anything else, or nothing (the server did not say why it ended, or said ``error``): ``length``
  when the token budget was used up, else ``aborted``.

Why ``aborted`` and not ``stop`` for an unexplained early end: ``aborted`` keeps the tokens and
marks the trajectory resumable, so the worst case is one extra request (a resumed response that
really was finished ends again at once with a real reason). ``stop`` would tell the trainer the
model chose to end there and silently train on a truncated trajectory as if it were complete.
(vLLM's adapter used to say ``stop`` here and SGLang's ``aborted``; now both say ``aborted``.)

**Error bodies.** Servers answer a rejected request with one of a few JSON shapes
(``{"error": {"message", "param"}}`` from vLLM's ``create_error_response`` and SGLang's
``_create_error_response``, ``{"object": "error", "message", "param"}`` for schema errors,
FastAPI's ``{"detail": ...}``) or plain text; :func:`error_message` reads all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import orjson

from rollfleet.types import StopReason

#: Server finish reasons with a meaning of their own; anything else follows the budget rule.
FINISH_REASONS: dict[str, StopReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "aborted",
    "aborted": "aborted",
    "repetition": "stop",
}


def stop_reason(finish_reason: Optional[str], num_tokens: int, budget: Optional[int]) -> StopReason:
    """``stop | length | aborted`` for a server's finish reason (see the module docstring)."""
    known = FINISH_REASONS.get(finish_reason) if isinstance(finish_reason, str) else None
    if known is not None:
        return known
    if budget is not None and num_tokens >= budget:
        return "length"
    return "aborted"


def error_message(status: int, raw: bytes) -> tuple[str, Any]:
    """(message, param) of an error response, whatever its body shape."""
    try:
        body = orjson.loads(raw)
    except ValueError:
        return (raw.decode("utf-8", "replace").strip() or f"HTTP {status}"), None
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping):
            return str(err.get("message", err)), err.get("param")
        if isinstance(err, str):
            return err, None
        if "message" in body:
            return str(body["message"]), body.get("param")
        if "detail" in body:
            return str(body["detail"]), None
    return str(body), None


__all__ = ["FINISH_REASONS", "stop_reason", "error_message"]
