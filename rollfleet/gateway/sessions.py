"""Who may end a session: the caller that holds it, or an operator.

A session id is the caller's own string (``X-Session-ID``, ``session_id`` or ``user``), so anyone
who guesses one could otherwise end another caller's session (``DELETE /v1/sessions/{id}``) and
send its next turn to a cold prefix cache. The response to the turn that opens a session carries
``X-Rollfleet-Session-Key``: an HMAC of the id under this gateway's secret (``gateway.session_secret``,
random per process unless set, so that several gateways behind one address agree). Reading,
scoring or ending the session takes that key, or the admin token. Only that first response: handed
out on every turn, the key went to anyone who sent one turn under a known id. A gateway remembers
the last :data:`MAX_ISSUED` ids it gave a key for (one it forgot, or that another gateway opened,
gives the key again), and forgets an id when its session is ended, so a new one may take it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from typing import Optional

from starlette.requests import Request

from rollfleet.gateway.errors import GatewayError

SESSION_KEY_HEADER = "X-Rollfleet-Session-Key"

#: Session ids a gateway remembers having given a key for (the oldest forgotten first).
MAX_ISSUED = 1 << 16


def header_matches(value: str, secret: bytes) -> bool:
    """Whether a header's value is ``secret``, in constant time. Compared as the header's bytes
    (HTTP headers arrive latin-1 decoded): compare_digest refuses a str with non-ASCII characters,
    which would be a 500 rather than a 403."""
    return hmac.compare_digest(value.strip().encode("latin-1", "replace"), secret)


class SessionKeys:
    def __init__(
        self, secret: Optional[str] = None, admin_token: Optional[str] = None, remember: int = MAX_ISSUED
    ) -> None:
        self._secret = (secret or secrets.token_hex(32)).encode()
        self._admin = admin_token
        self._issued: OrderedDict[str, None] = OrderedDict()
        self._remember = remember

    def key(self, session_id: str) -> str:
        return hmac.new(self._secret, session_id.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:32]

    def issue(self, session_id: str) -> Optional[str]:
        """The session's key for the response to its first turn; None for every later turn."""
        if session_id in self._issued:
            self._issued.move_to_end(session_id)
            return None
        self._issued[session_id] = None
        if len(self._issued) > self._remember:
            self._issued.popitem(last=False)
        return self.key(session_id)

    def forget(self, session_id: str) -> None:
        """The session ended: a new one under the same id is given the key again."""
        self._issued.pop(session_id, None)

    def check(self, request: Request, session_id: str) -> None:
        """Raise 403 unless ``request`` holds ``session_id``'s key or the admin token."""
        given = request.headers.get(SESSION_KEY_HEADER, "")
        if given and header_matches(given, self.key(session_id).encode()):
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if self._admin and scheme.lower() == "bearer" and header_matches(token, self._admin.encode()):
            return
        raise GatewayError(
            403,
            f"session {session_id!r} (its trajectory, reward and end) takes the {SESSION_KEY_HEADER} header its responses carried "
            "(or the admin token)",
            "permission_error",
            SESSION_KEY_HEADER,
            "session_not_yours",
        )


__all__ = ["MAX_ISSUED", "SessionKeys", "SESSION_KEY_HEADER", "header_matches"]
