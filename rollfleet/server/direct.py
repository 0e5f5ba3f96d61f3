"""The caller's side of a replica's direct data plane: one multiplexed connection per replica,
and a handle that sends ``generate`` over it while every other call still goes to the Ray actor.

:class:`DirectHandle` is what the fleet controller hands to clients in its snapshots: it pickles
to (actor handle, data-plane address, replica id, token), so it travels to any process (agent-loop
workers, the gateway, trainers); each process opens its own connections lazily, one per event
loop and replica, and shares them among all its requests.

Failure semantics are the ones the client's retry rules expect from a Ray call: a connection that
drops gives :class:`ReplicaUnavailable` (quarantine, re-route); a data plane that cannot be reached
at all sends the request through the actor instead (a dead replica then fails there, typed);
errors raised by the replica arrive as their own types (``InvalidRequest`` stays not retryable),
and a cancelled call cancels the request on the replica.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import weakref
from typing import Any, AsyncGenerator, AsyncIterator, Optional, Union

from rollfleet.errors import ReplicaUnavailable
from rollfleet.server import wire
from rollfleet.types import ReplicaResponse, SamplingParams, TokenDelta
from rollfleet.utils.refs import cancel as cancel_call

logger = logging.getLogger(__name__)

#: Data-plane addresses already warned about (unreachable, so requests took the Ray path).
_WARNED: set[str] = set()

#: How long opening a connection to a replica may take before the replica counts as unavailable.
CONNECT_TIMEOUT_S = 5.0
#: How long an address that could not be reached is not tried again (its callers take Ray).
UNREACHABLE_RETRY_S = 30.0


class DirectConnection(asyncio.Protocol):
    """A multiplexed connection to one replica's data plane (use :func:`get_connection`)."""

    def __init__(self, address: str, replica_id: str, token: str, allow_pickle: bool = False) -> None:
        self.address = address
        self.replica_id = replica_id
        self._token = token
        self.allow_pickle = allow_pickle
        self._reader = wire.FrameReader(allow_pickle=allow_pickle)
        #: Call id -> the future of a call, or the queue of a streamed call's parts.
        self._pending: dict[int, Union[asyncio.Future[Any], asyncio.Queue[Any]]] = {}
        self._ids = itertools.count(1)
        self._transport: Optional[asyncio.Transport] = None
        self._closed_reason: Optional[str] = None

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        transport.write(wire.hello_frame(self._token))  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        try:
            for message in self._reader.feed(data):
                self._deliver(message)
        except Exception as exc:
            self._fail_all(f"bad frame from the replica: {exc!r}")
            if self._transport is not None:
                self._transport.close()

    def _deliver(self, message: list[Any]) -> None:
        if message[1] == wire.PART:
            queue = self._pending.get(message[0])
            if isinstance(queue, asyncio.Queue):
                queue.put_nowait(wire.decode_part(message[2]))
            return
        future = self._pending.pop(message[0], None)
        if isinstance(future, asyncio.Queue):
            kind, body = message[1], message[2]
            future.put_nowait(wire.decode_response(body, message[3]) if kind == wire.OK else wire.decode_error(body))
            return
        if future is None or future.done():
            return  # cancelled meanwhile
        if message[1] == wire.OK:
            future.set_result(wire.decode_response(message[2], message[3]))
        else:
            future.set_exception(wire.decode_error(message[2]))

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._fail_all(f"data-plane connection to {self.address} lost" + (f": {exc!r}" if exc else ""))
        self._transport = None

    def _fail_all(self, reason: str) -> None:
        self._closed_reason = reason
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if isinstance(future, asyncio.Queue):
                future.put_nowait(ReplicaUnavailable(self.replica_id, reason))
            elif not future.done():
                future.set_exception(ReplicaUnavailable(self.replica_id, reason))

    # ------------------------------------------------------------------ calls
    @property
    def is_open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    async def generate_with_load(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Optional[SamplingParams] = None,
        **kwargs: Any,
    ) -> ReplicaResponse:
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ReplicaUnavailable(self.replica_id, self._closed_reason or "data-plane connection closed")
        call_id = next(self._ids)
        frame = wire.generate_frame(call_id, request_id, prompt_ids, sampling_params, kwargs, self.allow_pickle)
        future: asyncio.Future[ReplicaResponse] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        transport.write(frame)
        try:
            return await future
        except asyncio.CancelledError:
            if self._pending.pop(call_id, None) is not None and self.is_open:
                self._transport.write(wire.cancel_frame(call_id))  # type: ignore[union-attr]
            raise

    async def generate_stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: Optional[SamplingParams] = None,
        **kwargs: Any,
    ) -> AsyncGenerator[Union[TokenDelta, ReplicaResponse], None]:
        """The replica's :meth:`~rollfleet.server.replica.Replica.generate_stream` over this
        connection; leaving the loop early cancels the call on the replica."""
        transport = self._transport
        if transport is None or transport.is_closing():
            raise ReplicaUnavailable(self.replica_id, self._closed_reason or "data-plane connection closed")
        call_id = next(self._ids)
        frame = wire.generate_frame(
            call_id, request_id, prompt_ids, sampling_params, kwargs, self.allow_pickle, stream=True
        )
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._pending[call_id] = queue
        transport.write(frame)
        ended = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                ended = isinstance(item, ReplicaResponse)
                yield item
                if ended:
                    return
        finally:
            if not ended and self._pending.pop(call_id, None) is not None and self.is_open:
                self._transport.write(wire.cancel_frame(call_id))  # type: ignore[union-attr]

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


# ---------------------------------------------------------------------- connection pool
#: Per event loop: address -> open connection, or the task that is opening it.
_POOLS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Any]]" = weakref.WeakKeyDictionary()


async def get_connection(
    address: str, replica_id: str = "", token: str = "", allow_pickle: bool = False
) -> DirectConnection:
    """The open connection of this event loop to ``address`` (opened once, however many callers
    ask at the same time); :class:`ReplicaUnavailable` when the replica cannot be reached."""
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None:
        pool = _POOLS[loop] = {}
    entry = pool.get(address)
    if isinstance(entry, DirectConnection):
        if entry.is_open:
            return entry
        entry = None
    elif isinstance(entry, _Unreachable):
        if loop.time() < entry.until:  # each caller paid the connect timeout again
            raise ReplicaUnavailable(replica_id or address, entry.reason)
        entry = None
    if entry is None:
        entry = pool[address] = loop.create_task(_open(address, replica_id, token, allow_pickle))
    try:
        conn = await asyncio.shield(entry)
    except Exception as exc:
        if pool.get(address) is entry:
            del pool[address]
            if isinstance(exc, ReplicaUnavailable):
                pool[address] = _Unreachable(f"{exc.reason} (within the last {UNREACHABLE_RETRY_S:g}s)", loop)
        raise
    pool[address] = conn
    return conn


class _Unreachable:
    """A pool entry: the address was unreachable; until ``until`` callers hear so at once."""

    __slots__ = ("reason", "until")

    def __init__(self, reason: str, loop: asyncio.AbstractEventLoop) -> None:
        self.reason = reason
        self.until = loop.time() + UNREACHABLE_RETRY_S


async def _open(address: str, replica_id: str, token: str, allow_pickle: bool) -> DirectConnection:
    host, _, port = address.rpartition(":")
    loop = asyncio.get_running_loop()
    try:
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: DirectConnection(address, replica_id, token, allow_pickle), host, int(port)),
            CONNECT_TIMEOUT_S,
        )
    except (OSError, asyncio.TimeoutError) as exc:
        raise ReplicaUnavailable(replica_id or address, f"cannot reach its data plane at {address}: {exc!r}") from exc
    return conn  # asyncio sets TCP_NODELAY on TCP transports: small frames are not delayed


def drop_connection(address: str, reason: str) -> None:
    """Fail this event loop's calls to ``address`` now, with :class:`ReplicaUnavailable` (they are
    re-routed), and close the connection: its replica was declared dead, and a stopped or hung
    process would otherwise hold them until it is killed, however long that takes."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    pool = _POOLS.get(loop)
    entry = pool.pop(address, None) if pool else None
    if isinstance(entry, DirectConnection):
        entry._fail_all(reason)
        entry.close()


def close_connections() -> None:
    """Close this event loop's connections (tests, shutdown)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    for entry in (_POOLS.pop(loop, None) or {}).values():
        if isinstance(entry, DirectConnection):
            entry.close()
        elif isinstance(entry, asyncio.Task):
            entry.cancel()


# ---------------------------------------------------------------------- handle
def _warn_ray_path(address: str, exc: ReplicaUnavailable) -> None:
    """Say once per address that its requests go through Ray (slower; streams arrive whole)."""
    if address not in _WARNED:
        _WARNED.add(address)
        logger.warning("%s; sending its requests through Ray instead (streams arrive as one piece)", exc)


class _DirectCall:
    __slots__ = ("_handle", "_output_only")

    def __init__(self, handle: "DirectHandle", output_only: bool) -> None:
        self._handle = handle
        self._output_only = output_only

    def remote(
        self, request_id: str, prompt_ids: list[int], sampling_params: Optional[SamplingParams] = None, **kwargs: Any
    ):
        """Like a Ray call: returns an awaitable (a task; cancelling it cancels the request)."""
        return asyncio.ensure_future(self._call(request_id, prompt_ids, sampling_params, kwargs))

    async def _call(self, request_id: str, prompt_ids: list[int], sampling_params: Any, kwargs: dict[str, Any]):
        handle = self._handle
        try:
            conn = await get_connection(handle.address, handle.replica_id, handle.token, handle.allow_pickle)
        except ReplicaUnavailable as exc:
            if handle.actor is None:
                raise
            # The port may be closed to us (a firewall that lets only Ray's ports through) while the
            # replica is fine: take the Ray path. A dead replica fails there too, as it should.
            _warn_ray_path(handle.address, exc)
            return await self._through_ray(request_id, prompt_ids, sampling_params, kwargs)
        try:
            response = await conn.generate_with_load(request_id, prompt_ids, sampling_params, **kwargs)
        except wire.CannotCarry:
            if handle.actor is None:
                raise
            # Values JSON cannot carry (pickle off on the data plane), or a request over its frame
            # limit: Ray carries them.
            return await self._through_ray(request_id, prompt_ids, sampling_params, kwargs)
        return response.output if self._output_only else response

    async def _through_ray(self, request_id: str, prompt_ids: list[int], sampling_params: Any, kwargs: dict[str, Any]):
        actor = self._handle.actor
        method = actor.generate if self._output_only else actor.generate_with_load
        return await _cancelled_with_caller(method.remote(request_id, prompt_ids, sampling_params, **kwargs))


async def _cancelled_with_caller(ref: Any) -> Any:
    """Await a Ray call; a caller that gives up cancels it on the replica too. Awaiting an
    ``ObjectRef`` from a task that is cancelled does not cancel the actor's call: the fallback's
    cancelled and timed-out requests ran to their end, holding a batch slot, and a timed-out one
    was generated twice (the client retried it elsewhere)."""
    try:
        return await ref
    except asyncio.CancelledError:
        cancel_call(ref)
        raise


class DirectHandle:
    """A replica actor handle whose ``generate`` / ``generate_with_load`` take the data plane.

    Every other attribute is the actor's (``handle.update_weights.remote(...)`` is a Ray call), so
    code written against actor handles works unchanged.
    """

    __slots__ = ("actor", "address", "replica_id", "token", "allow_pickle")

    def __init__(
        self, actor: Any, address: str, replica_id: str = "", token: str = "", allow_pickle: bool = False
    ) -> None:
        self.actor = actor
        self.address = address
        self.replica_id = replica_id
        self.token = token
        self.allow_pickle = allow_pickle

    @property
    def generate_with_load(self) -> _DirectCall:
        return _DirectCall(self, output_only=False)

    @property
    def generate(self) -> _DirectCall:
        return _DirectCall(self, output_only=True)

    async def stream_generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: Optional[SamplingParams] = None, **kwargs: Any
    ) -> AsyncIterator[Union[TokenDelta, ReplicaResponse]]:
        """Streamed generation over the data plane (tokens as they are sampled, then the output
        with the load); through Ray when the data plane cannot carry it, as one final item."""
        try:
            conn = await get_connection(self.address, self.replica_id, self.token, self.allow_pickle)
        except ReplicaUnavailable as exc:
            if self.actor is None:
                raise
            _warn_ray_path(self.address, exc)  # the port is closed to us while the replica may be fine
            conn = None
        if conn is not None:
            stream = conn.generate_stream(request_id, prompt_ids, sampling_params, **kwargs)
            try:
                first = await stream.__anext__()
            except wire.CannotCarry:
                if self.actor is None:
                    raise
                conn = None  # values JSON cannot carry (pickle off on the data plane), or too large
        if conn is None:
            ref = self.actor.generate_with_load.remote(request_id, prompt_ids, sampling_params, **kwargs)
            yield await _cancelled_with_caller(ref)
            return
        try:
            yield first
            async for item in stream:
                yield item
        finally:
            await stream.aclose()

    def drop_connection(self, reason: str) -> None:
        """See :func:`drop_connection` (the fleet view calls it when the replica is declared dead)."""
        drop_connection(self.address, reason)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in DirectHandle.__slots__:
            raise AttributeError(name)  # not set yet (unpickling) or a protocol probe
        return getattr(self.actor, name)

    def __reduce__(self):
        return (DirectHandle, (self.actor, self.address, self.replica_id, self.token, self.allow_pickle))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DirectHandle) and self.address == other.address and self.actor == other.actor

    def __hash__(self) -> int:
        return hash((self.address, self.replica_id))

    def __repr__(self) -> str:
        return f"DirectHandle({self.replica_id or '?'} @ {self.address})"


__all__ = [
    "DirectConnection",
    "DirectHandle",
    "get_connection",
    "drop_connection",
    "close_connections",
    "CONNECT_TIMEOUT_S",
]
