"""A streamed generation fails and lives as a whole one does. Against a minimal SSE server in this
process that streams like vLLM's ``/inference/v1/generate`` (a ``data:`` line per token, then the
final chunk with the weight-version spans, or an in-band error event where vLLM reports its
engine's failures): the error is the replica's (``ReplicaUnavailable``, retried elsewhere by the
client, counted), as a whole request's HTTP 500 is; and a server streaming tokens whose ``/health``
is slow is busy, not dead."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import pytest
from aiohttp import web

from rollfleet.engines.vllm import VLLMEngine
from rollfleet.errors import ReplicaUnavailable
from rollfleet.types import TokenDelta

pytestmark = pytest.mark.unit

FAIL = 1  # a prompt starting with this token gets the error event at the end of its stream


class StreamingServer:
    def __init__(self) -> None:
        self.slow_health = False
        self.token_delay_s = 0.05

    async def health(self, request: web.Request) -> web.Response:
        if self.slow_health:
            await asyncio.sleep(2.0)
        return web.Response(text="ok")

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": "default"})

    async def anything_else(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"error": {"message": "engine core died", "code": 500}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        count = body["sampling_params"]["max_tokens"]
        for _ in range(count - 1):
            chunk = {"choices": [{"index": 0, "token_ids": [5], "logprobs": {"content": [{"logprob": -0.1}]}}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(self.token_delay_s)
        if body["token_ids"][0] == FAIL:
            await resp.write(b'data: {"error": {"message": "EngineCore encountered an issue", "code": 500}}\n\n')
        else:
            last = {"index": 0, "token_ids": [6], "logprobs": {"content": [{"logprob": -0.1}]},
                    "finish_reason": "length", "weight_versions": [{"version": "default", "start": 0, "end": count}]}  # fmt: skip
            await resp.write(b"data: " + json.dumps({"choices": [last]}).encode() + b"\n\n")
            if (body.get("stream_options") or {}).get("include_usage"):  # as vLLM: the usage alone, last
                usage = {"prompt_tokens": len(body["token_ids"]), "completion_tokens": count,
                         "prompt_tokens_details": {"cached_tokens": 7}}  # fmt: skip
                await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def engine() -> AsyncIterator[tuple[VLLMEngine, StreamingServer]]:
    server = StreamingServer()
    app = web.Application()
    app.router.add_get("/health", server.health)
    app.router.add_get("/weight_info", server.weight_info)
    app.router.add_post("/inference/v1/generate", server.generate)
    app.router.add_route("*", "/{path:.*}", server.anything_else)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    eng = VLLMEngine(
        "fake", max_model_len=100, base_url=f"http://127.0.0.1:{port}", vocab_size=50, rl_routes=True,
        health_timeout_s=0.3, startup_timeout_s=10,
    )  # fmt: skip
    await eng.start()
    try:
        yield eng, server
    finally:
        await eng.shutdown()
        await runner.cleanup()


async def _drain(stream: Any) -> list[Any]:
    return [item async for item in stream]


async def test_an_error_event_in_the_stream_is_the_replicas_failure_like_a_whole_requests_500(engine):
    eng, _ = engine
    with pytest.raises(ReplicaUnavailable, match="HTTP 500: engine core died"):
        await eng.generate("whole", [FAIL, 2], {"max_tokens": 4})
    with pytest.raises(ReplicaUnavailable, match="stream failed: .*EngineCore encountered an issue"):
        await _drain(eng.generate_stream("streamed", [FAIL, 2], {"max_tokens": 4}))
    assert eng.stats()["num_errors"] == 2
    items = await _drain(eng.generate_stream("fine", [2, 2], {"max_tokens": 4}))  # it serves on
    assert [t for i in items if isinstance(i, TokenDelta) for t in i.token_ids] == [5, 5, 5, 6]
    assert items[-1].token_ids == [5, 5, 5, 6] and items[-1].stop_reason == "length"


async def test_a_server_streaming_tokens_is_busy_not_dead_while_its_health_check_is_slow(engine):
    eng, server = engine
    stream = asyncio.ensure_future(_drain(eng.generate_stream("long", [2, 2], {"max_tokens": 40})))
    await asyncio.sleep(0.3)  # tokens are arriving (one every 0.05 s); no whole answer came back yet
    server.slow_health = True
    health = await eng.health()
    assert health.healthy and "busy" in health.detail, health
    server.slow_health = False
    items = await asyncio.wait_for(stream, 10)
    assert len(items[-1].token_ids) == 40


async def test_a_streamed_delta_leaves_its_versions_unknown_and_a_replica_does_not_fill_them_in():
    """vLLM names a streamed token's weights only in the last chunk's spans. Its deltas said None,
    which the replica reads as "the version this attempt started on" and filled in, so a stream
    cut after a keep commit labelled the new weights' tokens with the old version (and the
    client's cut, which must drop unknown versions, found them all known)."""
    from rollfleet.engines.vllm.wire import GenerateStream
    from rollfleet.server.replica import Replica
    from tests.manager.test_control_faults import config

    chunk = {"choices": [{"token_ids": [5, 6], "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]}}]}
    delta = GenerateStream().feed(b"data: " + json.dumps(chunk).encode())
    assert delta is not None and delta.token_ids == [5, 6] and delta.token_versions == []

    replica = Replica("r", config())
    await replica.start(version=3)

    async def stream(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        yield delta
        raise ReplicaUnavailable("r", "the server went away (injected)")

    replica.engine.generate_stream = stream  # type: ignore[method-assign]
    items = []
    with pytest.raises(ReplicaUnavailable):
        async for item in replica.generate_stream("s", [1, 2, 3], {"max_tokens": 4}):
            items.append(item)
    assert [i.token_versions for i in items] == [[]]  # unknown stays unknown
    await replica.shutdown()


async def test_a_stream_asks_for_its_usage_and_reports_the_prompt_tokens_the_cache_served(engine):
    """vLLM sends the usage of a stream only when asked (``stream_options.include_usage``), in a
    last chunk without choices: a streamed output never said what its prefix cache served."""
    eng, _ = engine
    items = await _drain(eng.generate_stream("u", [3, 4, 5], {"max_tokens": 3}))
    out = items[-1]
    assert out.token_ids == [5, 5, 6] and out.extra_fields["cached_tokens"] == 7
