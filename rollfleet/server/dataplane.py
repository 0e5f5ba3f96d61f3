"""The replica's side of the direct data plane: a TCP listener that runs ``generate_with_load``.

Each client process keeps one connection to each replica and multiplexes every request over it
(see :mod:`rollfleet.server.wire` for the frames and why they replace a Ray call per request).
Every request runs as its own task in the replica's event loop, exactly as a Ray call would, so
validation, the pause gate, version stamps and load reports are the same code.

Cancellation crosses the wire: a ``CANCEL`` frame, or the connection closing, cancels the
request's task, which aborts it in the engine, so a client that gives up never leaves work (or an
in-flight count) behind on the replica.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import random
import secrets
from typing import Any, AsyncGenerator, AsyncIterator, Optional, Protocol, Union, cast

from rollfleet.server import wire
from rollfleet.types import ReplicaResponse, TokenDelta

logger = logging.getLogger(__name__)


class GeneratesWithLoad(Protocol):
    async def generate_with_load(
        self, request_id: str, prompt_ids: list[int], sampling_params: Optional[dict] = None, **kwargs: Any
    ) -> ReplicaResponse: ...

    def generate_stream(
        self, request_id: str, prompt_ids: list[int], sampling_params: Optional[dict] = None, **kwargs: Any
    ) -> AsyncIterator[Union[TokenDelta, ReplicaResponse]]: ...


class _Connection(asyncio.Protocol):
    """One client connection: decode frames, run each request as a task, write its answer."""

    def __init__(self, target: GeneratesWithLoad, server: "DataPlaneServer") -> None:
        self._target = target
        self._server = server
        # Before HELLO: one small JSON frame at most, so an unauthenticated peer costs ~1 KB.
        self._reader = wire.FrameReader(allow_pickle=False, max_frame_bytes=wire.HELLO_MAX_FRAME_BYTES)
        self._hello = False
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._transport: Optional[asyncio.Transport] = None
        self._deadline: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        server = self._server
        if len(server._connections) >= server.max_connections:
            logger.warning("data plane: %d connections open (the cap); refusing one more", len(server._connections))
            transport.close()
            return
        server._connections.add(self)
        self._deadline = asyncio.get_running_loop().call_later(server.hello_timeout_s, self._no_hello)

    def _no_hello(self) -> None:
        if not self._hello and self._transport is not None:
            logger.warning("data plane: dropping a peer that sent no HELLO within %.1fs", self._server.hello_timeout_s)
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            for message in self._reader.feed(data):
                self._dispatch(message)
        except Exception as exc:  # not our protocol: drop the peer, keep serving everyone else
            logger.warning("data plane: closing a connection that sent a bad frame: %r", exc)
            assert self._transport is not None
            self._transport.close()

    def _dispatch(self, message: Any) -> None:
        op = message[0]
        if not self._hello:
            if (
                op != wire.HELLO
                or not isinstance(message[1], str)
                or not hmac.compare_digest(message[1], self._server.token)
            ):
                raise wire.FrameError("the first frame must be HELLO with this replica's token")
            self._hello = True
            if self._deadline is not None:
                self._deadline.cancel()
            self._reader.allow_pickle = self._server.allow_pickle
            self._reader.max_frame_bytes = wire.MAX_FRAME_BYTES
            return
        if op in (wire.GENERATE, wire.STREAM):
            _, call_id, request_id, prompt_ids, sampling_params, kwargs = message
            run = self._run if op == wire.GENERATE else self._stream
            task = asyncio.get_running_loop().create_task(
                run(call_id, request_id, prompt_ids, sampling_params, kwargs or {})
            )
            self._tasks[call_id] = task
        elif op == wire.CANCEL:
            running = self._tasks.pop(message[1], None)
            if running is not None:
                running.cancel()
        else:
            raise wire.FrameError(f"unknown op {op!r}")

    async def _run(
        self, call_id: int, request_id: str, prompt_ids: list[int], sampling_params: Optional[dict], kwargs: dict
    ) -> None:
        try:
            response = await self._target.generate_with_load(request_id, prompt_ids, sampling_params, **kwargs)
        except asyncio.CancelledError:
            return  # the client cancelled (or went away); it expects no answer
        except Exception as exc:  # every error goes back to the caller, typed
            frame = wire.error_frame(call_id, exc)
        else:
            try:
                frame = wire.response_frame(call_id, response, self._server.allow_pickle)
            except Exception as exc:  # an output neither JSON nor pickle can carry: say so, never hang
                frame = wire.error_frame(call_id, exc)
        finally:
            self._tasks.pop(call_id, None)
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(frame)

    async def _stream(
        self, call_id: int, request_id: str, prompt_ids: list[int], sampling_params: Optional[dict], kwargs: dict
    ) -> None:
        """A STREAM call: a PART frame per batch of new tokens, then the whole output (or an error)."""
        frame = b""
        stream: Optional[AsyncGenerator] = None
        try:  # arguments the call does not take fail here, answered as an error like the rest
            stream = cast(
                AsyncGenerator, self._target.generate_stream(request_id, prompt_ids, sampling_params, **kwargs)
            )
            async for item in stream:
                transport = self._transport
                if transport is None or transport.is_closing():
                    return  # the client went away: closing the stream aborts the generation
                if isinstance(item, TokenDelta):
                    transport.write(wire.part_frame(call_id, item, self._server.allow_pickle))
                else:
                    frame = wire.response_frame(call_id, item, self._server.allow_pickle)
        except asyncio.CancelledError:
            return
        except Exception as exc:
            frame = wire.error_frame(call_id, exc)
        finally:
            if stream is not None:
                await stream.aclose()
            self._tasks.pop(call_id, None)
        transport = self._transport
        if frame and transport is not None and not transport.is_closing():
            transport.write(frame)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._server._connections.discard(self)
        tasks, self._tasks = self._tasks, {}
        for task in tasks.values():
            task.cancel()  # nobody is waiting for these any more: abort them in the engine
        self._transport = None


#: How long a new connection has to say HELLO before it is dropped.
HELLO_TIMEOUT_S = 5.0
#: Most connections open at once (one per client process and event loop is the normal use).
MAX_CONNECTIONS = 1024


class DataPlaneServer:
    """Listens on ``host:port`` (port 0: any free one) and serves ``target.generate_with_load``
    to connections that open with its :attr:`token` within ``hello_timeout_s``, at most
    ``max_connections`` at once; pickle frames only with ``allow_pickle`` (``rollout.data_plane_pickle``)."""

    def __init__(
        self,
        target: GeneratesWithLoad,
        host: str = "127.0.0.1",
        port: int = 0,
        port_range: Optional[tuple[int, int]] = None,
        *,
        allow_pickle: bool = False,
        hello_timeout_s: float = HELLO_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.target = target
        self.host = host
        self.port = port
        self.port_range = port_range
        self.allow_pickle = allow_pickle
        self.hello_timeout_s = hello_timeout_s
        self.max_connections = max_connections
        #: What a client must say first (see :mod:`rollfleet.server.wire`); it reaches clients
        #: only through the controller, over Ray.
        self.token = secrets.token_hex(16)
        self._server: Optional[asyncio.AbstractServer] = None
        self._connections: set[_Connection] = set()

    async def start(self) -> str:
        """Bind (a free port of ``port_range`` when given, tried from a random start so that the
        replicas of one node rarely collide) and listen."""
        loop = asyncio.get_running_loop()
        if self.port_range is None:
            candidates = [self.port]
        else:
            low, high = self.port_range
            span = high - low + 1
            first = random.randrange(span)
            candidates = [low + (first + i) % span for i in range(span)]
        for port in candidates:
            try:
                self._server = await loop.create_server(lambda: _Connection(self.target, self), self.host, port)
                break
            except OSError as exc:
                if self.port_range is None or exc.errno != errno.EADDRINUSE:
                    raise
        else:
            raise OSError(
                errno.EADDRINUSE, f"rollout.data_plane_ports: every port of {self.port_range} is taken on {self.host}"
            )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.address

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    async def close(self) -> None:
        """Stop listening and drop every connection (their requests are cancelled)."""
        if self._server is None:
            return
        self._server.close()
        for conn in list(self._connections):
            if conn._transport is not None:
                conn._transport.close()
        await self._server.wait_closed()
        self._server = None


__all__ = ["DataPlaneServer", "HELLO_TIMEOUT_S", "MAX_CONNECTIONS"]
