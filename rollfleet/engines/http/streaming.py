"""Streamed generation for HTTP engines whose server streams tokens (vLLM's ``/inference/v1/generate``
with ``"stream": true``): :meth:`StreamingGenerate.generate_stream`.

The stream takes the same path as a whole generation (``HTTPEngine._admitted``: the in-flight
table's pause/abort gate, the engine-side request id, error counts; the abort on cancel) and
differs only in reading: the server's SSE lines are fed to the engine's stream reader, which turns
them into :class:`~rollfleet.types.TokenDelta` s (the lines that arrived together as one) and, at
the end, into the body a whole answer would have had, so the final output is parsed by the very
code that parses whole answers (versions, stop reasons, logprobs), and a stream that fails on the
server's side is the replica's failure, as a whole answer's would be. Leaving the stream early, or
a cancel, aborts the request on the server.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable, Optional, Protocol, Union

import aiohttp

from rollfleet.engines.http.inflight import Inflight
from rollfleet.engines.http.transport import is_stale, transport_error
from rollfleet.engines.http.wire import error_message
from rollfleet.errors import InvalidRequest, ReplicaUnavailable
from rollfleet.types import SamplingParams, TokenDelta, TokenOutput

if TYPE_CHECKING:  # pragma: no cover
    from rollfleet.engines.http.engine import HTTPEngine

    _Base = HTTPEngine
else:
    _Base = object


class StreamReader(Protocol):
    """Reads one streamed answer: a delta per SSE line with tokens, then the whole answer's body."""

    def request_fields(self) -> dict[str, Any]:
        """What the request adds to stream this way (beside ``"stream": true``)."""
        ...

    def feed(self, line: bytes) -> Optional[TokenDelta]: ...

    def body(self) -> bytes: ...


class StreamingGenerate(_Base):
    """Mixin for an :class:`~rollfleet.engines.http.HTTPEngine` whose server can stream."""

    def _stream_reader(self) -> Optional[StreamReader]:
        """A reader for one streamed answer, or None when this server cannot stream."""
        return None

    async def generate_stream(
        self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams, **kwargs: Any
    ) -> AsyncIterator[Union[TokenDelta, TokenOutput]]:
        reader = self._stream_reader()
        if reader is None:
            yield await self.generate(request_id, prompt_ids, sampling_params, **kwargs)
            return
        async with self._admitted(request_id, prompt_ids, sampling_params, kwargs) as (call, body, budget):
            body["stream"] = True
            body.update(reader.request_fields())
            done = False
            try:
                if call.aborted.is_set():
                    done = True
                    yield self._counted(TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted"))
                    return
                self._check_alive()
                call.sent = True
                async for delta in self._read(call, body, reader, prompt_ids):
                    yield delta
                try:
                    out = self._counted(self._parse_output(reader.body(), budget), call)
                except InvalidRequest:
                    raise
                except (ValueError, LookupError, TypeError) as e:
                    raise self._unexpected(e) from e
                done = True
                yield out
            finally:
                if not done and call.sent:
                    self._abort_in_background([call.wire_id])  # the caller left: stop the server's work

    async def _read(
        self, call: Inflight, body: dict[str, Any], reader: StreamReader, prompt_ids: list[int]
    ) -> AsyncIterator[TokenDelta]:
        link = self._link
        assert link.clients is not None
        resend = True
        while True:
            path, data, headers = self._generate_call(call.wire_id, body)
            try:
                resp = await link.clients.session.post(path, data=data, headers=headers)
                break
            except (aiohttp.ClientError, TimeoutError) as e:
                # The server closed an idle keep-alive connection just as we reused it (a starved
                # server does, as soon as its loop runs again): once more on a fresh connection,
                # under a new id in case the first was read after all, as a whole generate does.
                if not (resend and is_stale(e) and link.alive()):
                    raise await transport_error("generate", e, self.replica_label, link.url, link.gone) from e
                resend = False
                self._abort_in_background([call.wire_id])
                if call.aborted.is_set():
                    return  # the body read then is an aborted, empty answer
                self._table.rename(call, self._wire_id(call.request_id))
        try:
            async with resp:
                if resp.status in (400, 422):
                    raise self._invalid(*error_message(resp.status, await resp.read()), prompt_ids, body)
                if resp.status >= 400:
                    message = error_message(resp.status, await resp.read())[0][:1000]
                    raise ReplicaUnavailable(
                        self.replica_label, f"generate: {self.server_name} answered HTTP {resp.status}: {message}"
                    )
                pending = b""
                async for data in resp.content.iter_any():  # whatever has arrived: one delta for all of it
                    link.check()  # the server died: the read may not notice for a while
                    self._last_progress = time.monotonic()  # a server streaming tokens is busy, not dead
                    *lines, pending = (pending + data).split(b"\n")
                    merged = _merge(reader.feed(line) for line in lines)
                    if merged is not None:
                        yield merged
                if pending.strip():
                    merged = _merge([reader.feed(pending)])
                    if merged is not None:
                        yield merged
        except (aiohttp.ClientError, TimeoutError) as e:
            raise await transport_error("generate", e, self.replica_label, link.url, link.gone) from e
        except InvalidRequest:
            raise
        except (ValueError, LookupError, TypeError) as e:  # an error event, a line we cannot read
            raise self._unexpected(e) from e

    def _unexpected(self, error: Exception) -> ReplicaUnavailable:
        """A stream that failed on the server's side (vLLM sends its engine's errors in the
        stream) is the replica's failure, as the same answer to a whole request is: the client
        retries it elsewhere, and the replica counts an error."""
        return ReplicaUnavailable(self.replica_label, f"generate: {self.server_name}'s stream failed: {error}")


def _merge(deltas: Iterable[Optional[TokenDelta]]) -> Optional[TokenDelta]:
    """The deltas of the lines read at once, as one (the fewer hops per token, the cheaper a stream
    is for the replica and the gateway on the engine's cores; it costs no latency: they are all here)."""
    out: Optional[TokenDelta] = None
    for delta in deltas:
        if delta is None:
            continue
        if out is None:
            out = TokenDelta(list(delta.token_ids), list(delta.log_probs), list(delta.token_versions))
        else:
            out.token_ids += delta.token_ids
            out.log_probs += delta.log_probs
            out.token_versions += delta.token_versions
    return out


__all__ = ["StreamingGenerate", "StreamReader"]
