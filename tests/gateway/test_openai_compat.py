"""Where the gateway reads a request as OpenAI means it, in-process (one sim replica, the tiny model's
tokenizer): what a client sends reaches the model as the client meant it."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from gateway_support import MODEL, in_process_gateway

from rollfleet.config import GatewayConfig

pytestmark = pytest.mark.unit


async def test_developer_instructions_reach_a_template_that_knows_only_system():
    server, gw, replica = await in_process_gateway(
        GatewayConfig(), response_length=8, time_scale=50.0, mean_response_tokens=4
    )
    try:

        async def prompt_of(role: str) -> list[int]:
            body: dict[str, Any] = {
                "model": MODEL,
                "max_tokens": 2,
                "return_token_ids": True,
                "messages": [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "hi"}],
            }
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                resp = await http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()["prompt_token_ids"]

        developer = await prompt_of("developer")
        assert "Answer in French." in gw.codec.decode(developer)  # the template used to drop it
        assert developer == await prompt_of("system")
        # and through the openai client, as a newer agent sends it: the same prompt as a system one
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        used = []
        for role in ("developer", "system"):
            done = await client.chat.completions.create(
                model=MODEL, messages=[{"role": role, "content": "Answer in French."}], max_tokens=2
            )
            assert done.usage is not None
            used.append(done.usage.prompt_tokens)
        await client.close()
        assert used[0] == used[1]
    finally:
        await server.stop()
        await replica.shutdown()

