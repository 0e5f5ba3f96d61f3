"""Streaming as the fleet samples: the first chunk leaves the gateway long before the last token is
sampled, the chunks add up to the output, errors before the first token keep their status, and a
caller that hangs up stops the generation (one in-process sim replica, no Ray)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
from gateway_support import MODEL, slow_gateway

pytestmark = pytest.mark.unit

LONG = {"max_tokens": 300, "ignore_eos": True}


gateway = slow_gateway


async def sse(http: httpx.AsyncClient, route: str, body: dict[str, Any]) -> tuple[list[dict], list[float], float]:
    """The stream's events and when each arrived (seconds after the request was sent)."""
    events, stamps = [], []
    started = time.monotonic()
    async with http.stream("POST", route, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                stamps.append(time.monotonic() - started)
    return events, stamps, time.monotonic() - started


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_the_first_chunk_arrives_long_before_the_last_and_chunks_add_up(route):
    async with gateway() as (server, gw, _):
        chat = route.endswith("chat/completions")
        body: dict[str, Any] = {"model": MODEL, "stream": True, "return_token_ids": True, **LONG}
        body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "count 1 2 3"}
        body["stream_options"] = {"include_usage": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            events, stamps, total = await sse(http, route, body)
        choices = [e["choices"][0] for e in events if e["choices"]]
        texts = [(c["delta"].get("content") or "") if chat else c["text"] for c in choices]
        ids = [t for c in choices for t in c.get("token_ids") or []]
        with_text = [s for s, t in zip(stamps, texts) if t]
        assert len(ids) == 300 and len(with_text) > 10
        assert with_text[0] < 0.3 * total, (with_text[0], total)  # the first token, long before the last
        assert "".join(texts) == gw.codec.decode(ids)
        assert choices[-1]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 300


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_several_choices_stream_side_by_side_each_adding_up_to_its_output(route):
    """``n`` = 3: each choice is its own generation, and their chunks go out interleaved as they
    are sampled, not one choice after another when all have ended."""
    async with gateway() as (server, gw, _):
        chat = route.endswith("chat/completions")
        body: dict[str, Any] = {"model": MODEL, "stream": True, "return_token_ids": True, "n": 3, **LONG}
        body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "count 1 2 3"}
        body["stream_options"] = {"include_usage": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            events, stamps, total = await sse(http, route, body)
        order = [e["choices"][0]["index"] for e in events if e["choices"] and e["choices"][0].get("token_ids")]
        assert set(order) == {0, 1, 2}
        switches = sum(a != b for a, b in zip(order, order[1:]))
        assert switches > 10, order  # interleaved: every choice is sampled at once
        for index in range(3):
            mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
            text = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in mine)
            ids = [t for c in mine for t in c.get("token_ids") or []]
            assert len(ids) == 300 and text == gw.codec.decode(ids) and mine[-1]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 900


async def test_the_openai_client_streams_and_the_session_turn_is_recorded():
    async with gateway() as (server, gw, _):
        client = openai.AsyncOpenAI(base_url=f"{server.url}/sessions/s1/v1", api_key="-", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=40
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        record = gw.trajectories.trajectory("s1")
        branch = record["branches"][0]
        sampled = [t for t, m in zip(branch["token_ids"], branch["mask"]) if m]
        assert record["num_turns"] == 1 and 1 <= len(sampled) <= 40
        assert "".join(pieces) == gw.codec.decode(sampled)


@pytest.mark.parametrize("n", [1, 3])
async def test_a_refused_stream_keeps_its_status_and_a_caller_that_hangs_up_stops_the_generation(n, caplog):
    async with gateway() as (server, _, replica):
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            too_long = {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 100_000}
            resp = await http.post("/v1/completions", json=too_long)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
            body = {"model": MODEL, "prompt": "count", "stream": True, "max_tokens": 300, "ignore_eos": True, "n": n}
            async with http.stream("POST", "/v1/completions", json=body) as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                        break  # hang up after the first piece of text
            deadline = time.monotonic() + 5
            while replica._book.requests and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert replica._book.requests == 0 and replica.engine.stats()["num_aborted"] == n
            assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text  # closed cleanly
            ok = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
            assert ok.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_n_seeded_choices_are_n_samples_each_seeded_as_vllm_seeds_them(stream):
    """``n`` = 3 with a ``seed``: choice i is the sample of ``seed + i`` (vLLM's children), not
    three copies of one sample (every choice came back the same: a GRPO group of one answer). The
    usage counts the prompt once, as OpenAI's does (it counted it three times)."""
    async with gateway() as (server, gw, _):
        short = {
            "model": MODEL,
            "prompt": "count 1 2 3",
            "max_tokens": 12,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            if stream:
                body = {**short, "n": 3, "seed": 7, "stream": True, "stream_options": {"include_usage": True}}
                events, _, _ = await sse(http, "/v1/completions", body)
                usage = events[-1]["usage"]
                got = [
                    [t for e in events if e["choices"] and e["choices"][0]["index"] == i
                     for t in e["choices"][0].get("token_ids") or []]
                    for i in range(3)
                ]  # fmt: skip
            else:
                resp = await http.post("/v1/completions", json={**short, "n": 3, "seed": 7})
                got = [c["token_ids"] for c in resp.json()["choices"]]
                usage = resp.json()["usage"]
            alone = []
            for seed in (7, 8, 9):
                resp = await http.post("/v1/completions", json={**short, "seed": seed})
                alone.append(resp.json()["choices"][0]["token_ids"])
            one = resp.json()["usage"]
        assert got == alone
        assert usage == {
            "prompt_tokens": one["prompt_tokens"],
            "completion_tokens": 36,
            "total_tokens": one["prompt_tokens"] + 36,
        }
        assert len({tuple(ids) for ids in got}) == 3


async def test_streams_give_the_offsets_and_prompt_ids_the_whole_answer_gives():
    """A replayed batch stream advanced its text offsets by each piece's text, not by its tokens'
    (they differ where a token is part of a character): offsets went backwards. A live chat
    stream put ``prompt_token_ids`` inside its first choice (the whole answer, the replay and vLLM
    put it at the chunk's top level), and a live completion of n choices gave it to the first only."""
    from gateway_support import in_process_gateway

    from rollfleet.config import GatewayConfig

    server, _, replica = await in_process_gateway(
        GatewayConfig(), response_length=64, time_scale=50.0, mean_response_tokens=40
    )
    http = httpx.AsyncClient(base_url=server.url, timeout=30)
    try:
        for seed in range(1, 6):
            body = {"model": MODEL, "prompt": [[1, 2, 3], [4, 5, 6]], "max_tokens": 40, "seed": seed,
                    "logprobs": 0, "ignore_eos": True}  # fmt: skip
            whole = (await http.post("/v1/completions", json=body)).json()
            events, _, _ = await sse(http, "/v1/completions", {**body, "stream": True})
            for i in (0, 1):
                streamed = [x for e in events for c in e["choices"] if c["index"] == i and c.get("logprobs")
                            for x in c["logprobs"]["text_offset"]]  # fmt: skip
                assert streamed == whole["choices"][i]["logprobs"]["text_offset"], (seed, i)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "return_token_ids": True}  # fmt: skip
        prompt = (await http.post("/v1/chat/completions", json=chat)).json()["prompt_token_ids"]
        events, _, _ = await sse(http, "/v1/chat/completions", {**chat, "stream": True})
        assert events[0]["prompt_token_ids"] == prompt and "prompt_token_ids" not in events[0]["choices"][0]
        done = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "n": 2, "return_token_ids": True, "stream": True}
        events, _, _ = await sse(http, "/v1/completions", done)
        openings = [c for e in events for c in e["choices"] if "prompt_token_ids" in c]
        assert sorted(c["index"] for c in openings) == [0, 1]
    finally:
        await http.aclose()
        await server.stop()
        await replica.shutdown()
