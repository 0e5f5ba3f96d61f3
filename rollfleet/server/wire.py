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

Unpickling runs code, and the replica listens on its node's address, so a connection must first
prove it belongs to the cluster: its first frame is ``[HELLO, token]`` (JSON), with the random
token the replica reported to the controller over Ray; a replica decodes no pickle frame before
that. (Ray's own calls are pickled too; this keeps the data plane from being a wider door.)

Client -> replica: ``[HELLO, token]`` once, then ``[GENERATE, call_id, request_id, prompt_ids,
sampling_params, kwargs]`` or ``[CANCEL, call_id]``. Replica -> client: ``[call_id, OK, output, load]`` or
``[call_id, ERROR, exception]`` (always pickled).
"""

from __future__ import annotations

import math
import pickle
import struct
from typing import Any, Iterator, Optional

import orjson

from rollfleet.types import LoadReport, ReplicaResponse, TokenOutput

JSON = 0
PICKLE = 1

GENERATE = 1
CANCEL = 2
HELLO = 3

OK = 0
ERROR = 1

_HEADER = struct.Struct("<IB")
HEADER_SIZE = _HEADER.size

#: A frame larger than this is a protocol error, not a request (a 1M-token prompt is ~8 MB).
MAX_FRAME_BYTES = 256 * 1024 * 1024


class FrameError(ValueError):
    """The peer sent bytes that are not a frame of this protocol."""


def pack(message: Any) -> bytes:
    """One frame: JSON when orjson can encode the message, pickle otherwise."""
    try:
        payload = orjson.dumps(message)
        kind = JSON
    except TypeError:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        kind = PICKLE
    return _HEADER.pack(len(payload) + 1, kind) + payload


def pack_pickled(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload) + 1, PICKLE) + payload


class FrameReader:
    """Cuts a byte stream into decoded messages (feed it whatever ``data_received`` gets).

    ``allow_pickle`` False refuses pickle frames (a peer that has not said hello yet). Messages
    are decoded one at a time as the caller iterates, so a flag set while handling one message
    holds for the next.
    """

    __slots__ = ("_buf", "allow_pickle")

    def __init__(self, allow_pickle: bool = True) -> None:
        self._buf = bytearray()
        self.allow_pickle = allow_pickle

    def feed(self, data: bytes) -> Iterator[Any]:
        buf = self._buf
        buf += data
        pos = 0
        end = len(buf)
        try:
            while end - pos >= HEADER_SIZE:
                length, kind = _HEADER.unpack_from(buf, pos)
                if length < 1 or length > MAX_FRAME_BYTES:
                    raise FrameError(f"frame length {length} is outside 1..{MAX_FRAME_BYTES}")
                stop = pos + 4 + length
                if stop > end:
                    break
                payload = memoryview(buf)[pos + HEADER_SIZE : stop]
                try:
                    if kind == JSON:
                        message = orjson.loads(payload)
                    elif kind == PICKLE:
                        if not self.allow_pickle:
                            raise FrameError("pickle frame before the peer said hello")
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
    call_id: int, request_id: str, prompt_ids: list[int], sampling_params: Optional[dict], kwargs: dict[str, Any]
) -> bytes:
    return pack([GENERATE, call_id, request_id, prompt_ids, sampling_params, kwargs])


def hello_frame(token: str) -> bytes:
    return pack([HELLO, token])


def cancel_frame(call_id: int) -> bytes:
    return pack([CANCEL, call_id])


# ---------------------------------------------------------------------- responses
def response_frame(call_id: int, response: ReplicaResponse) -> bytes:
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
        ],
    ]
    return pack(message)


def error_frame(call_id: int, exc: BaseException) -> bytes:
    try:
        return pack_pickled([call_id, ERROR, exc])
    except Exception:  # an exception that cannot be pickled: keep its type name and text
        return pack_pickled([call_id, ERROR, RuntimeError(f"{type(exc).__name__}: {exc}")])


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
    "cancel_frame",
    "hello_frame",
    "response_frame",
    "error_frame",
    "decode_response",
    "GENERATE",
    "CANCEL",
    "HELLO",
    "OK",
    "ERROR",
]
