"""Evidence, for the real-vLLM tests, that does not lag behind the server: a streaming probe.

Why not vLLM's gauges (``num_requests_running``, KV usage): they are published with its stats, so
a test that reads them sees the past, and how far in the past depends on how loaded the machine
is. A streaming completion reports each decode step as it happens: once a probe sent *after* some
requests has streamed ``n`` tokens, vLLM has run ``n`` decode steps since, and (continuous
batching, room for every request) each request it already held took part in every one of them.
Counting in the server's own steps also makes a bound independent of the machine's speed (see
``test_cancelled_generate_is_aborted_on_the_server``).

What was traded away: the probe is one more request in the batch, so a test that counts the
server's requests counts it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, Awaitable, Callable, Optional

import httpx

#: A failure bound, not a sleep: on an idle 2-core machine the awaited evidence arrives in well
#: under a second; it may take far longer while other test suites share the cores.
EVIDENCE_TIMEOUT_S = 120.0


async def wait_for(
    predicate: Callable[[], bool | Awaitable[bool]], what: str, timeout: float = EVIDENCE_TIMEOUT_S
) -> None:
    """Poll ``predicate`` (sync or async) until it holds; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        ok = predicate()
        if not isinstance(ok, bool):
            ok = await ok
        if ok:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:.0f}s: {what}")
        await asyncio.sleep(0.02)


class StreamingProbe:
    """A streaming ``/v1/completions`` request sent straight to a vLLM server at ``address``.

    ``async with StreamingProbe(address) as probe: await probe.wait_tokens(32)``. It stops when the
    server ends it (finished, aborted by a pause, the server killed) or when the block exits (the
    connection is closed, and vLLM aborts a request whose client went away).
    """

    def __init__(
        self, address: str, prompt: Optional[list[int]] = None, max_tokens: int = 4000, uds: Optional[str] = None
    ) -> None:
        self.address = address.rstrip("/")
        self.uds = uds  # the server's private socket (``address`` then only names the host)
        self.prompt = prompt or [3, 1, 4, 1, 5, 9, 2, 6]
        self.max_tokens = max_tokens
        self.tokens = 0  # tokens streamed so far
        self.ended: Optional[str] = None  # why the stream ended, once it has
        self._task: Optional[asyncio.Task] = None
        self._http: Optional[httpx.AsyncClient] = None

    @classmethod
    def to(cls, server: Any, **kw: Any) -> "StreamingProbe":
        """A probe to the vLLM server of ``server`` (an engine, or a replica's ``ReplicaInfo``): over
        its private socket when it has one (its ``address()`` is then the metrics exporter)."""
        socket = getattr(server, "socket_path", None) or getattr(server, "server_socket", None)
        if socket:
            return cls("http://localhost", uds=socket, **kw)
        return cls(server.address() if callable(server.address) else server.address, **kw)

    async def __aenter__(self) -> "StreamingProbe":
        self._http = httpx.AsyncClient(
            base_url=self.address,
            timeout=httpx.Timeout(None, connect=30.0),
            transport=httpx.AsyncHTTPTransport(uds=self.uds),
        )
        for attempt in range(3):  # a server busy streaming may accept late on a loaded machine
            try:
                # Connection: close: the stream below gets a fresh connection, never one the
                # server may be closing (its keep-alive timer runs on a starved event loop).
                models = await self._http.get("/v1/models", headers={"Connection": "close"})
                model = models.json()["data"][0]["id"]
                break
            except httpx.ConnectTimeout:
                if attempt == 2:
                    raise
        body = {
            "model": model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        self._task = asyncio.create_task(self._read(body))
        return self

    async def _read(self, body: dict) -> None:
        for attempt in range(3):  # a connection dropped before the first byte: send it again
            try:
                await self._read_once(body)
                return
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError) as e:
                if self.tokens or attempt == 2:
                    self.ended = f"stream failed: {e!r}"
                    return

    async def _read_once(self, body: dict) -> None:
        assert self._http is not None
        try:
            async with self._http.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    self.ended = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    for choice in json.loads(line[5:]).get("choices", []):
                        logprobs = choice.get("logprobs") or {}
                        self.tokens += len(logprobs.get("tokens") or []) or 1
                        if choice.get("finish_reason"):
                            self.ended = f"finished: {choice['finish_reason']}"
            self.ended = self.ended or "stream closed"
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError):
            raise  # _read decides: sent again before the first token, a failure after it
        except (httpx.HTTPError, ValueError) as e:
            self.ended = f"stream failed: {e!r}"

    async def wait_tokens(self, n: int, timeout: float = EVIDENCE_TIMEOUT_S) -> None:
        """Until the probe has streamed ``n`` tokens in all (fails if it ends first)."""

        def streamed() -> bool:
            if self.tokens < n and self.ended is not None:
                raise AssertionError(f"the probe ended after {self.tokens} tokens ({self.ended}), before {n}")
            return self.tokens >= n

        await wait_for(streamed, f"the probe streamed {n} tokens (has {self.tokens})", timeout)

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._http is not None:
            await self._http.aclose()
