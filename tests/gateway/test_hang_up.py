"""A caller that hangs up before a whole (non-streamed) answer: the fleet stops generating it, and
its session is left as if the request had never come (no turn recorded, no key handed out)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from gateway_support import MODEL, slow_gateway

from rollfleet.gateway.sessions import SESSION_KEY_HEADER

pytestmark = pytest.mark.unit

ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/completions/tokens"]


gateway = slow_gateway


def body(route: str, max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "session_id": "s1"}
    if route.endswith("chat/completions"):
        return out | {"messages": [{"role": "user", "content": "hi"}]}
    if route.endswith("tokens"):
        return out | {"prompt_token_ids": [1, 2, 3]}
    return out | {"prompt": "count 1 2 3"}


@pytest.mark.parametrize("route", ROUTES)
async def test_a_caller_that_hangs_up_stops_its_generation_and_a_retry_gets_the_session(route):
    async with gateway() as (server, gw, replica):
        async with httpx.AsyncClient(base_url=server.url, timeout=0.3) as http:
            with pytest.raises(httpx.ReadTimeout):  # the openai client's timeout closes the connection so
                await http.post(route, json=body(route, 300))
        deadline = time.monotonic() + 5
        while replica._book.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        stats = replica.engine.stats()
        # aborted, not generated to its end for nobody
        assert replica._book.requests == 0 and stats["num_aborted"] == 1 and stats["num_finished"] == 0
        assert gw.trajectories.get("s1") is None  # no turn the agent never saw
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            retry = await http.post(route, json=body(route, 4))
        assert retry.status_code == 200, retry.text
        assert retry.headers.get(SESSION_KEY_HEADER)  # the retry opens the session: its key is the caller's
        if route.endswith("chat/completions"):
            assert gw.trajectories.trajectory("s1")["num_turns"] == 1
        assert 'status="499"' in (await http_metrics(server.url))


async def http_metrics(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return (await http.get("/metrics")).text


async def test_a_stream_whose_caller_hangs_up_before_its_first_token_stops_and_keeps_the_session_key():
    """Queued behind another request, a stream waited for its first token whatever its caller did:
    generated for nobody once it got one, and handed the session's one-time key to nobody, so the
    retry could never read, score or end its own session."""
    from gateway_support import load_codec

    from rollfleet.client import LLMServerClient
    from rollfleet.config import GatewayConfig, RolloutConfig, SimEngineConfig
    from rollfleet.gateway import Gateway, GatewayServer
    from rollfleet.server.local import LocalHandle
    from rollfleet.server.replica import Replica

    codec = load_codec()
    sim = SimEngineConfig(vocab_size=codec.vocab_size, time_scale=5.0, mean_response_tokens=50, max_num_seqs=1)
    rollout = RolloutConfig(name="sim", model=MODEL, prompt_length=256, response_length=300, max_model_len=512, sim=sim)
    replica = Replica("r0", rollout, 0)
    await replica.start(version=0)
    client = LLMServerClient(rollout, servers={"r0": LocalHandle(replica)})
    server = await GatewayServer(Gateway(client, codec, config=GatewayConfig(), rollout=rollout).app).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            blocker = asyncio.ensure_future(http.post(ROUTES[0], json=body(ROUTES[0], 300) | {"session_id": "b"}))
            await asyncio.sleep(0.1)
            async with httpx.AsyncClient(base_url=server.url, timeout=0.2) as impatient:
                with pytest.raises(httpx.ReadTimeout):
                    async with impatient.stream("POST", ROUTES[0], json=body(ROUTES[0], 300) | {"stream": True}):
                        pass
            await blocker
            deadline = time.monotonic() + 5
            while replica._book.requests and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            stats = replica.engine.stats()
            assert stats["num_aborted"] == 1 and stats["num_steps"] == 300  # the blocker's steps alone
            retry = await http.post(ROUTES[0], json=body(ROUTES[0], 4))
            assert retry.status_code == 200 and retry.headers.get(SESSION_KEY_HEADER)
    finally:
        await server.stop()
        await replica.shutdown()
