"""A simulated fleet behind a gateway on a free loopback port, served in the test's event loop."""

from __future__ import annotations

import pytest
from gateway_support import load_codec, stack_config

from rollfleet.gateway import GatewayStack


@pytest.fixture(scope="module")
async def stack(ray_session):
    """The shared gateway (no admin token: /admin is off). Tests must not change the fleet.

    One per module, torn down as the module ends: this folder is no package, so a "package"
    fixture lived until the session's end, past the cluster tests that stop the session's Ray and
    start it again; stopping its fleet then waited on actors of a Ray that was gone, and the suite
    hung at its last teardown."""
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
