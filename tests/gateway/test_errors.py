"""Bad input gets a 4xx naming the field, in OpenAI's error shape, and the gateway keeps serving.
Fleet failures map to 503 (no replica) and 504 (timeout)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from gateway_support import MODEL, load_codec

from rollfleet.client import LLMServerClient
from rollfleet.config import GatewayConfig, RetryConfig, RolloutConfig
from rollfleet.gateway import Gateway, GatewayServer

LONG_TEXT = " ".join(f"word{i}" for i in range(400))  # well over the 512-token context

#: (route, body, status, param)
BAD_REQUESTS: list[tuple[str, Any, int, Any]] = [
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages[0].role",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": 42}]},
        400,
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content[0].type",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG_TEXT}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        400,
        "temperature",
    ),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 100_000}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG_TEXT}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["never ever stop here"]}, 400, "stop[0]"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 10**30}, 400, "seed"),  # past 64 bits
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 2**40}, 400, "top_k"),
    # scorers read the prompt's logprobs from echo + logprobs: the fleet computes none (they were missing)
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 0}, 400, "logprobs"),
    # caught by the replica (InvalidRequest), renamed to the caller's fields
    ("/v1/completions/tokens", {"model": MODEL, "prompt_token_ids": [5, 10**6]}, 400, "prompt_token_ids[1]"),
    (
        "/v1/completions/tokens",
        {"model": MODEL, "prompt_token_ids": [5], "max_tokens": 4, "min_tokens": 9},
        400,
        "min_tokens",
    ),
    ("/v1/completions/tokens", {"model": MODEL, "prompt_token_ids": ["a"]}, 400, "prompt_token_ids[0]"),
    # checked against the vocabulary only when a stop string brought the tokenizer in
    (
        "/v1/completions/tokens",
        {"model": MODEL, "prompt_token_ids": [5], "logit_bias": {"99999999": 5}},
        400,
        "logit_bias.99999999",
    ),
    ("/v1/completions/tokens", {"model": MODEL, "prompt_token_ids": []}, 400, "prompt_token_ids"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/completions", b"{not json", 400, None),
]


@pytest.mark.ray
async def test_bad_requests_name_the_field_and_the_gateway_keeps_serving(http, oai):
    async def good(i: int) -> str:
        resp = await oai.completions.create(model=MODEL, prompt=f"good request {i}", max_tokens=6)
        return resp.choices[0].finish_reason

    async def bad(route: str, body: Any) -> httpx.Response:
        if isinstance(body, bytes):
            return await http.post(route, content=body, headers={"content-type": "application/json"})
        return await http.post(route, json=body)

    goods = [good(i) for i in range(20)]
    bads = [bad(route, body) for route, body, _, _ in BAD_REQUESTS]
    results = await asyncio.gather(*goods, *bads)
    assert all(r in ("stop", "length") for r in results[:20])
    for (route, body, status, param), resp in zip(BAD_REQUESTS, results[20:]):
        assert resp.status_code == status, (route, body, resp.text)
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param, (route, body, error)
        assert error["message"]
    # and it still serves
    assert await good(99) in ("stop", "length")


@pytest.mark.ray
async def test_openai_client_raises_typed_errors(oai):
    with pytest.raises(openai.BadRequestError) as bad:
        await oai.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert bad.value.param == "max_tokens" and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as missing:
        await oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        await oai.post("/no/such/route", body={}, cast_to=httpx.Response)


# ---------------------------------------------------------------------- 503 / 504 without Ray
class _SlowClient(LLMServerClient):
    """A client whose replica never answers."""

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: Any = None, **kwargs: Any
    ) -> Any:
        await asyncio.sleep(3600)


async def _serve(client: LLMServerClient, **gateway: Any) -> tuple[GatewayServer, httpx.AsyncClient]:
    gw = Gateway(client, load_codec(), config=GatewayConfig(**gateway), rollout=client.config)
    server = await GatewayServer(gw.app).start()
    return server, httpx.AsyncClient(base_url=server.url, timeout=30)


@pytest.mark.unit
async def test_no_replica_is_503_and_timeout_is_504():
    retry = {"max_attempts": 2, "initial_backoff_s": 0.001}
    if "no_server_wait_s" in RetryConfig.model_fields:  # how long the client waits for a routable replica
        retry["no_server_wait_s"] = 0.05
    rollout = RolloutConfig(name="sim", prompt_length=256, max_model_len=512, retry=retry)
    server, http = await _serve(LLMServerClient(rollout, servers={}))
    try:
        resp = await http.post("/v1/completions/tokens", json={"model": MODEL, "prompt_token_ids": [1, 2]})
        assert resp.status_code == 503
        assert resp.json()["error"]["type"] == "service_unavailable_error"
        assert (await http.get("/health")).status_code == 503
    finally:
        await http.aclose()
        await server.stop()

    server, http = await _serve(_SlowClient(rollout, servers={}), request_timeout_s=0.2)
    try:
        resp = await http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert resp.status_code == 504
        assert resp.json()["error"]["type"] == "timeout_error"
        metrics = (await http.get("/metrics")).text
        assert 'rollfleet_gateway_requests_total{route="/v1/chat/completions",status="504"} 1.0' in metrics
    finally:
        await http.aclose()
        await server.stop()
