"""The gateway's data path: HTTP requests become ``client.generate`` calls, nothing more.

It is layered on the client only (``LLMServerClient.generate`` and ``finish_session``), never on
the manager: routing, stickiness, retries and abort/resume are the client's. With a
``FullyAsyncLLMServerClient`` a weight update in the middle of a request is resumed here, inside
the gateway, and the caller sees one uninterrupted response.

Sessions: a request with a session id uses it as the client's ``request_id``, so all turns of one
conversation land on one replica (and its prefix cache). A request without one gets a fresh id,
whose sticky entry is dropped when it finishes, so one-off requests never crowd real sessions out
of the client's sticky cache.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Optional, Sequence, Union, cast

from rollfleet.client import LLMServerClient
from rollfleet.gateway.metrics import GatewayMetrics
from rollfleet.gateway.sampling import choice_params
from rollfleet.types import SamplingParams, TokenDelta, TokenOutput
from rollfleet.utils.aio import gather_or_cancel

#: Request ids of session-less requests: unique across gateways (random prefix) and cheap (counter).
_RID_PREFIX = f"gw-{os.urandom(6).hex()}-"
_RID_COUNTER = itertools.count()


class GenerationService:
    """Runs the generations of one HTTP request through the fleet client."""

    def __init__(self, client: LLMServerClient, metrics: GatewayMetrics, timeout_s: float) -> None:
        self.client = client
        self.metrics = metrics
        self.timeout_s = timeout_s

    async def generate(
        self,
        route: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        n: int = 1,
        session_id: Optional[str] = None,
    ) -> list[TokenOutput]:
        """``n`` samples of every prompt, prompt-major (choice index = prompt * n + sample)."""
        request_id = session_id if session_id is not None else f"{_RID_PREFIX}{next(_RID_COUNTER)}"
        client = self.client
        try:
            if len(prompts) == 1 and n == 1:
                outputs = [
                    await self._bounded(client.generate(request_id, prompt_ids=prompts[0], sampling_params=params))
                ]
            else:
                jobs = [
                    client.generate(request_id, prompt_ids=prompt, sampling_params=choice_params(params, i))
                    for prompt in prompts
                    for i in range(n)
                ]
                outputs = await self._bounded(gather_or_cancel(jobs))
        finally:
            if session_id is None:
                client.finish_session(request_id)
        self.metrics.observe_outputs(route, sum(len(p) for p in prompts) * n, outputs)
        return outputs

    async def generate_stream(
        self, route: str, prompt: list[int], params: SamplingParams, *, session_id: Optional[str] = None
    ) -> AsyncIterator[Union[TokenDelta, TokenOutput]]:
        """One generation, streamed (token deltas, then the whole output), within ``request_timeout_s``
        overall; leaving early cancels it in the fleet."""
        request_id = session_id if session_id is not None else f"{_RID_PREFIX}{next(_RID_COUNTER)}"
        stream = cast(
            AsyncGenerator, self.client.generate_stream(request_id, prompt_ids=prompt, sampling_params=params)
        )
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            while True:
                remaining = deadline - asyncio.get_running_loop().time()
                try:
                    item = await asyncio.wait_for(stream.__anext__(), max(remaining, 0.0))
                except StopAsyncIteration:
                    return
                if isinstance(item, TokenOutput):
                    self.metrics.observe_outputs(route, len(prompt), [item])
                yield item
        finally:
            await stream.aclose()
            if session_id is None:
                self.client.finish_session(request_id)

    async def _bounded(self, awaitable: Awaitable[Any]) -> Any:
        """Await under ``request_timeout_s``; a timeout cancels the fleet request too (504)."""
        # ``asyncio.timeout`` (3.11+) bounds an await without the extra task ``wait_for`` creates;
        # the version test is inline so that type checkers see it.
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(self.timeout_s):
                return await awaitable
        return await asyncio.wait_for(awaitable, self.timeout_s)  # pragma: no cover

    def finish_session(self, session_id: str) -> bool:
        """Forget a session's replica (its prefix cache stays warm for whoever comes next)."""
        return self.client.balancer.finish_session(session_id)


__all__ = ["GenerationService"]
