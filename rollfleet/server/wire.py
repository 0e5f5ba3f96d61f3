"""The data plane's wire format: length-prefixed frames of JSON (orjson), pickle only as a fallback.

Why a wire format of our own instead of a Ray actor call per request: a Ray call costs about a
millisecond of CPU spread over the caller, the callee and Ray's own threads, which on a small
machine is most of what a short request costs (see ``benchmarks/gateway.py`` and
``benchmarks/engine_overhead.py``). The data plane is one long-lived TCP connection per client
process and replica, multiplexing every request by a call id; a frame costs a few microseconds
to encode and decode. Ray stays the control plane (start, update weights, pause, probes).

Frame: ``<u32 length><u8 kind><payload>`` (little endian; ``length`` counts kind + payload).

* ``kind`` :data:`JSON`: an orjson array, the common case (token ids, floats, short strings);
* ``kind`` :data:`PICKLE`: a pickled tuple of the same shape, for what JSON cannot carry: typed
  exceptions (they keep their class and fields, as they do through Ray) and requests or outputs
  with non-JSON values (e.g. multimodal extras, ``routed_experts`` arrays).

Unpickling runs code, so pickle is off unless ``rollout.data_plane_pickle`` turns it on for every
process of the fleet: then a request or an output JSON cannot carry (multimodal extras, arrays)
travels pickled; without it such a request takes the Ray path instead, and such an output is an
error naming the setting. Errors always travel as JSON: the error's type name (one of
:mod:`rollfleet.errors`, else ``RuntimeError``) and the arguments it is rebuilt from.

The replica listens on its node's address, so a connection must first prove it belongs to the
cluster: its first frame is ``[HELLO, token]`` (JSON, at most :data:`HELLO_MAX_FRAME_BYTES`), with
the random token the replica reported to the controller over Ray, sent within the replica's
handshake deadline; until then the replica buffers no more than that one small frame.

Client -> replica: ``[HELLO, token]`` once, then ``[GENERATE, call_id, request_id, prompt_ids,
sampling_params, kwargs]``, ``[STREAM, ...the same]`` or ``[CANCEL, call_id]``. Replica -> client:
``[call_id, OK, output, load]`` or ``[call_id, ERROR, [type_name, args]]``; a STREAM call gets
``[call_id, PART, [token_ids, log_probs, token_versions]]`` frames as tokens are sampled first.
"""

from __future__ import annotations

import math
import pickle
import struct
from typing import Any, Iterator, Optional

import orjson

from rollfleet import errors as _errors_module
from rollfleet.server.validation import refuse_unencodable_params
from rollfleet.types import LoadReport, ReplicaResponse, TokenDelta, TokenOutput

#: rollfleet's own error types, by name: what an error frame may rebuild.
_ERRORS: dict[str, type[BaseException]] = {
    name: cls
    for name, cls in vars(_errors_module).items()
    if isinstance(cls, type) and issubclass(cls, _errors_module.RollfleetError)
}
#: Built-in errors an error frame keeps (by type and message): the client's retry rules and the
#: gateway's status codes tell them apart (a replica's TimeoutError is a 504, not a 500).
_BUILTIN_ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls for cls in (TimeoutError, ValueError, TypeError, RuntimeError, NotImplementedError)
}

JSON = 0
PICKLE = 1

GENERATE = 1
CANCEL = 2
HELLO = 3
STREAM = 4

OK = 0
ERROR = 1
PART = 2

_HEADER = struct.Struct("<IB")
HEADER_SIZE = _HEADER.size

#: A frame larger than this is a protocol error, not a request (a 1M-token prompt is ~8 MB).
MAX_FRAME_BYTES = 256 * 1024 * 1024
#: The largest frame a peer may send before its HELLO (a HELLO is ~50 bytes).
HELLO_MAX_FRAME_BYTES = 1024


class FrameError(ValueError):
    """The peer sent bytes that are not a frame of this protocol."""


class CannotCarry(Exception):
    """A message the data plane cannot carry: raised before anything is sent, so the connection
    and the other calls on it go on (a caller with the actor sends it through Ray instead)."""


class NeedsPickle(CannotCarry, TypeError):
    """A message JSON cannot carry, while pickle is off (``rollout.data_plane_pickle``)."""


class FrameTooLarge(CannotCarry, ValueError):
    """A message longer than :data:`MAX_FRAME_BYTES`: sent, the peer would close the connection,
    failing every call on it."""


def pack(message: Any, allow_pickle: bool = True) -> bytes:
    """One frame: JSON when orjson can encode the message, else pickle if allowed."""
    try:
        payload = orjson.dumps(message)
        kind = JSON
    except TypeError as exc:
        if not allow_pickle:
            raise NeedsPickle(f"not JSON-encodable ({exc}); rollout.data_plane_pickle is off") from None
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        kind = PICKLE
    if len(payload) + 1 > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"a frame of {len(payload) + 1} bytes is over the data plane's {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(payload) + 1, kind) + payload


class FrameReader:
    """Cuts a byte stream into decoded messages (feed it whatever ``data_received`` gets).

    ``allow_pickle`` False refuses pickle frames (a peer that has not said hello yet). Messages
    are decoded one at a time as the caller iterates, so a flag set while handling one message
    holds for the next.
    """

    __slots__ = ("_buf", "allow_pickle", "max_frame_bytes")

    def __init__(self, allow_pickle: bool = False, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self.allow_pickle = allow_pickle
        self.max_frame_bytes = max_frame_bytes

    def feed(self, data: bytes) -> Iterator[Any]:
        buf = self._buf
        buf += data
        pos = 0
        end = len(buf)
        try:
            while end - pos >= HEADER_SIZE:
                length, kind = _HEADER.unpack_from(buf, pos)
                if length < 1 or length > self.max_frame_bytes:
                    raise FrameError(f"frame length {length} is outside 1..{self.max_frame_bytes}")
                stop = pos + 4 + length
                if stop > end:
                    break
                payload = memoryview(buf)[pos + HEADER_SIZE : stop]
                try:
                    if kind == JSON:
                        message = orjson.loads(payload)
                    elif kind == PICKLE:
                        if not self.allow_pickle:
                            raise FrameError("pickle frame refused (before HELLO, or rollout.data_plane_pickle is off)")
                        message = pickle.loads(payload)
                    else:
                        raise FrameError(f"unknown frame kind {kind}")
                finally:
                    payload.release()
                pos = stop
                yield message
        finally:
            if pos:
                del buf[:pos]


# ---------------------------------------------------------------------- requests
def generate_frame(
    call_id: int,
    request_id: str,
    prompt_ids: list[int],
    sampling_params: Optional[dict],
    kwargs: dict[str, Any],
    allow_pickle: bool = False,
    *,
    stream: bool = False,
) -> bytes:
    """A GENERATE call, or with ``stream`` a STREAM call (its tokens come back in PART frames).
    A sampling parameter that JSON cannot carry unchanged is refused here, nested ones
    (``logit_bias``, ``passthrough``) too (:func:`~rollfleet.server.validation.refuse_unencodable`):
    orjson would send a NaN as null, which the replica reads as "not given" (the same request
    through Ray kept its NaN); ``sampling_params`` that is no dict is refused too, naming it."""
    refuse_unencodable_params(sampling_params)
    op = STREAM if stream else GENERATE
    return pack([op, call_id, request_id, prompt_ids, sampling_params, kwargs], allow_pickle)


def part_frame(call_id: int, delta: TokenDelta, allow_pickle: bool = False) -> bytes:
    """A stream's new tokens; what JSON cannot carry is pickled only where the connection allows
    it, as a response is (else ``NeedsPickle``: that call fails alone, its connection stays)."""
    return pack([call_id, PART, [delta.token_ids, delta.log_probs, delta.token_versions]], allow_pickle)


def decode_part(body: list[Any]) -> TokenDelta:
    token_ids, log_probs, versions = body
    if log_probs and None in log_probs:
        log_probs = [math.nan if x is None else x for x in log_probs]
    return TokenDelta(token_ids, log_probs, versions)


def hello_frame(token: str) -> bytes:
    return pack([HELLO, token])


def cancel_frame(call_id: int) -> bytes:
    return pack([CANCEL, call_id])


# ---------------------------------------------------------------------- responses
def response_frame(call_id: int, response: ReplicaResponse, allow_pickle: bool = False) -> bytes:
    out = response.output
    load = response.load
    message = [
        call_id,
        OK,
        [
            out.token_ids,
            out.log_probs,
            out.stop_reason,
            out.num_preempted,
            out.token_versions,
            out.extra_fields,
            out.routed_experts,
        ],
        [
            load.replica_id,
            load.inflight,
            load.inflight_tokens,
            load.running,
            load.waiting,
            load.kv_usage,
            load.weight_version,
            load.state,
            load.timestamp,
            load.by_client,
        ],
    ]
    return pack(message, allow_pickle)


def error_frame(call_id: int, exc: BaseException) -> bytes:
    """``[call_id, ERROR, [type_name, args]]`` as JSON: one of rollfleet's errors keeps its type and
    fields (rebuilt from the arguments its ``__reduce__`` names), anything else becomes a
    ``RuntimeError`` carrying its type name and text."""
    encoded: list[Any] = ["RuntimeError", [f"{type(exc).__name__}: {exc}"]]
    if _BUILTIN_ERRORS.get(type(exc).__name__) is type(exc):
        encoded = [type(exc).__name__, [str(exc)]]
    elif _ERRORS.get(type(exc).__name__) is type(exc):
        try:
            args = exc.__reduce__()[1]
            orjson.dumps(args)
            encoded = [type(exc).__name__, list(args)]
        except (TypeError, IndexError):
            pass
    return pack([call_id, ERROR, encoded])


def decode_error(encoded: Any) -> BaseException:
    """The exception an error frame describes (a ``RuntimeError`` when it cannot be rebuilt)."""
    try:
        name, args = encoded
        cls = _ERRORS.get(name) or _BUILTIN_ERRORS.get(name, RuntimeError)
        return cls(*args)
    except Exception:
        return RuntimeError(f"undecodable error from a replica: {encoded!r}")


def decode_response(body: list[Any], load: list[Any]) -> ReplicaResponse:
    token_ids, log_probs, stop_reason, num_preempted, token_versions, extra, routed = body
    if log_probs and None in log_probs:  # JSON has no NaN (a logprob the engine did not give): orjson wrote null
        log_probs = [math.nan if x is None else x for x in log_probs]
    output = TokenOutput.model_construct(
        token_ids=token_ids,
        log_probs=log_probs,
        routed_experts=routed,
        stop_reason=stop_reason,
        num_preempted=num_preempted,
        token_versions=token_versions,
        extra_fields=extra,
    )
    return ReplicaResponse(output, LoadReport(*load))


__all__ = [
    "FrameReader",
    "FrameError",
    "pack",
    "generate_frame",
    "part_frame",
    "decode_part",
    "cancel_frame",
    "hello_frame",
    "response_frame",
    "error_frame",
    "decode_error",
    "CannotCarry",
    "FrameTooLarge",
    "NeedsPickle",
    "HELLO_MAX_FRAME_BYTES",
    "decode_response",
    "GENERATE",
    "STREAM",
    "PART",
    "CANCEL",
    "HELLO",
    "OK",
    "ERROR",
]
