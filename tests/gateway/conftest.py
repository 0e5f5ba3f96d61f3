"""A simulated fleet behind a gateway on a free loopback port, served in the test's event loop."""

from __future__ import annotations

import pytest
from gateway_support import load_codec, stack_config

from rollfleet.gateway import GatewayStack


@pytest.fixture(scope="package")
async def stack(ray_session):
    """The shared gateway (no admin token: /admin is off). Tests must not change the fleet."""
    s = await GatewayStack.start(stack_config(), load_codec())
    yield s
    await s.stop()


@pytest.fixture
async def oai(stack):
    import openai

    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield client
    await client.close()


@pytest.fixture
async def http(stack):
    import httpx

    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        yield client
