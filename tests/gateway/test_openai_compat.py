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


async def test_a_streamed_completions_logprobs_offsets_are_a_whole_answers_and_a_session_url_lists_models():
    server, gw, replica = await in_process_gateway(
        GatewayConfig(), response_length=16, time_scale=50.0, mean_response_tokens=8
    )
    try:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        args: dict[str, Any] = {"model": MODEL, "prompt": "x y", "max_tokens": 12, "logprobs": 0}
        held_back = 0
        for seed in range(16):
            whole = await client.completions.create(**args, seed=seed, extra_body={"ignore_eos": True})
            text, tokens, offsets = "", [], []
            stream = await client.completions.create(**args, seed=seed, stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                choice = chunk.choices[0]
                text += choice.text
                if choice.logprobs is not None:
                    held_back += bool(choice.logprobs.tokens) and not choice.text  # part of a character
                    tokens += choice.logprobs.tokens or []
                    offsets += choice.logprobs.text_offset or []
            expected = whole.choices[0].logprobs
            assert expected is not None and (text, tokens) == (whole.choices[0].text, expected.tokens)
            assert offsets == expected.text_offset, seed
        assert held_back  # the case that shifted the offsets: tokens sent before their character was whole
        await client.close()
        # an agent handed a session's base URL lists the models first
        session = openai.AsyncOpenAI(base_url=f"{server.url}/sessions/s1/v1", api_key="-", max_retries=0)
        assert [m.id for m in (await session.models.list()).data] == [MODEL]
        await session.close()
    finally:
        await server.stop()
        await replica.shutdown()
