"""The gateway's limits: what a caller cannot make it do (no Ray: one in-process sim replica).

Each limit answers in the OpenAI error shape naming the field and the config field, and the
gateway goes on serving a good request right after.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
import pytest
from gateway_support import MODEL, in_process_gateway

from rollfleet.config import GatewayConfig
from rollfleet.gateway import Gateway, GatewayServer

pytestmark = pytest.mark.unit

#: The 209-byte kind of request that stalled every client for 7.5 s: the caller's own Jinja program.
NESTED_TEMPLATE = (
    "{% for a in range(999) %}{% for b in range(999) %}{% for c in range(99) %}x{% endfor %}{% endfor %}{% endfor %}"
)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@asynccontextmanager
async def gateway(
    server_options: Any = None, **limits: Any
) -> AsyncIterator[tuple[GatewayServer, httpx.AsyncClient, Gateway]]:
    """A gateway with these limits over one sim replica; all of it is shut down on the way out."""
    server, gw, replica = await in_process_gateway(
        GatewayConfig(**limits), response_length=16, time_scale=1000.0, mean_response_tokens=8, **(server_options or {})
    )
    http = httpx.AsyncClient(base_url=server.url, timeout=30)
    try:
        yield server, http, gw
    finally:
        await http.aclose()
        await server.stop()
        await replica.shutdown()


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """True once the server has closed the connection: end of stream, or a reset (a socket closed
    with our unread request bytes in it is reset, not shut down cleanly)."""
    try:
        return await asyncio.wait_for(reader.read(), 10) == b""
    except ConnectionResetError:
        return True


async def still_serves(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200, resp.text


def assert_error(resp: httpx.Response, status: int, param: Any, *words: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert all(w in error["message"] for w in words), error["message"]


async def test_a_callers_chat_template_is_refused_unless_the_operator_allows_it():
    async with gateway() as (server, http, _):
        body = {**CHAT, "chat_template_kwargs": {"chat_template": NESTED_TEMPLATE}}
        resp = await http.post("/v1/chat/completions", json=body)
        assert_error(resp, 400, "chat_template_kwargs.chat_template", "allow_caller_chat_template")
        ok = await http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
        assert ok.status_code == 200, ok.text  # template parameters are still welcome
        for key, value in (("tools", 5), ("add_generation_prompt", False), ("messages", 1)):
            clash = {**CHAT, "chat_template_kwargs": {key: value}}  # the request's own fields say these
            resp = await http.post("/v1/chat/completions", json=clash)
            assert_error(resp, 400, f"chat_template_kwargs.{key}", "not by chat_template_kwargs")
        await still_serves(http)
    async with gateway(allow_caller_chat_template=True) as (server, http, _):
        own = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"
        resp = await http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"chat_template": own}})
        assert resp.status_code == 200, resp.text


async def test_bodies_over_the_limit_are_refused_before_they_are_read():
    async with gateway(max_body_bytes=64 * 1024) as (server, http, _):
        big = {"model": MODEL, "prompt": "word " * 2_000_000, "max_tokens": 4}  # 10 MB
        resp = await http.post("/v1/completions", json=big)
        assert_error(resp, 413, None, "65536 bytes", "gateway.max_body_bytes")

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit holds while reading
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(100):
                yield b"x" * 4096
            yield b'"}'

        resp = await http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert_error(resp, 413, None, "gateway.max_body_bytes")
        await still_serves(http)


async def test_a_body_that_trickles_in_is_cut_off_at_the_body_timeout():
    async with gateway(body_timeout_s=0.5) as (server, http, _):
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"model": "tiny", '
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.read(4096), 10)
        assert head.startswith(b"HTTP/1.1 408"), head[:200]
        assert b"gateway.body_timeout_s" in head
        writer.close()
        await still_serves(http)


async def test_prompt_text_generations_and_session_ids_have_limits():
    async with gateway(max_prompt_chars=1000, max_generations=8, max_session_id_chars=16) as (server, http, gw):
        encoded: list[int] = []
        encode = gw.codec.encode
        gw.codec.encode = lambda *a, **k: encoded.append(1) or encode(*a, **k)  # type: ignore[method-assign]
        long = {**CHAT, "messages": [{"role": "user", "content": "x" * 1001}]}
        assert_error(await http.post("/v1/chat/completions", json=long), 400, "messages", "gateway.max_prompt_chars")
        big_tool = {"type": "function", "function": {"name": "f", "description": "x" * 1001, "parameters": {}}}
        tools = {**CHAT, "tools": [big_tool]}  # the tools' schemas are rendered into the prompt too
        assert_error(await http.post("/v1/chat/completions", json=tools), 400, "tools", "gateway.max_prompt_chars")
        # a schema's property names are rendered too: a key was never counted
        keyed = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"x" * 1001: {}}}}}
        resp = await http.post("/v1/chat/completions", json={**CHAT, "tools": [keyed]})
        assert_error(resp, 400, "tools", "gateway.max_prompt_chars")
        extra = {**CHAT, "messages": [{"role": "user", "content": "hi", "reasoning_content": "x" * 1001}]}
        assert_error(await http.post("/v1/chat/completions", json=extra), 400, "messages", "gateway.max_prompt_chars")
        batch = {"model": MODEL, "prompt": ["a b c"] * 3, "n": 3, "max_tokens": 2}
        assert_error(await http.post("/v1/completions", json=batch), 400, "prompt", "9 generations", "max_generations")
        # what a template renders from chat_template_kwargs (a RAG template's documents) counts too
        kwargs = {**CHAT, "chat_template_kwargs": {"documents": [{"text": "x" * 1001}]}}
        resp = await http.post("/v1/chat/completions", json=kwargs)
        assert_error(resp, 400, "chat_template_kwargs", "gateway.max_prompt_chars")
        # stop strings are tokenised on the event loop: their count and size are bounded
        many = {"model": MODEL, "prompt": "a", "max_tokens": 2, "stop": ["a"] * 33}
        assert_error(await http.post("/v1/completions", json=many), 400, "stop", "at most 32 items")
        long_stop = {"model": MODEL, "prompt": "a", "max_tokens": 2, "stop": "a" * 257}
        assert_error(await http.post("/v1/completions", json=long_stop), 400, "stop", "at most 256 characters")
        ids = {"model": MODEL, "prompt": "a", "max_tokens": 2, "stop_token_ids": [1] * 1025}
        assert_error(await http.post("/v1/completions", json=ids), 400, "stop_token_ids", "at most 1024 items")
        assert encoded == []  # none reached the tokenizer
        resp = await http.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "s" * 17})
        assert_error(resp, 400, "x-session-id", "max_session_id_chars")
        resp = await http.post("/v1/chat/completions", json={**CHAT, "session_id": "s" * 17})
        assert_error(resp, 400, "session_id", "17 characters")
        await still_serves(http)


async def test_json_nested_too_deep_for_the_template_is_a_400_naming_the_field():
    """A 1.2 KB body: tool-call arguments nested 600 levels failed the request with a 500
    (RecursionError, its traceback logged each time). The limit holds for the tools' schemas too."""
    async with gateway() as (server, http, gw):
        deep = "[" * 600 + "]" * 600
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
        resp = await http.post("/v1/chat/completions", json={**CHAT, "messages": messages})
        assert_error(resp, 400, "messages", "nested deeper than 64 levels")
        schema: dict = {}
        for _ in range(70):  # 70 schema levels: within what the body parser takes
            schema = {"type": "array", "items": schema}
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        assert_error(await http.post("/v1/chat/completions", json={**CHAT, "tools": [tool]}), 400, "tools", "nested")
        shallow = {**call, "function": {"name": "f", "arguments": '{"a": [[1, 2], {"b": 3}]}'}}
        ok = [messages[0], {**messages[1], "tool_calls": [shallow]}, messages[2]]
        assert (await http.post("/v1/chat/completions", json={**CHAT, "messages": ok})).status_code == 200
        await still_serves(http)


async def test_tokenizing_and_chat_templates_run_off_the_event_loop():
    async with gateway() as (server, http, gw):
        threads: list[str] = []
        codec = gw.codec
        encode, render = codec.encode, codec.render_chat

        def spy(fn: Any) -> Any:
            def wrapped(*a: Any, **k: Any) -> Any:
                threads.append(threading.current_thread().name)
                return fn(*a, **k)

            return wrapped

        codec.encode, codec.render_chat = spy(encode), spy(render)  # type: ignore[method-assign]
        await still_serves(http)
        resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a long text", "max_tokens": 2})
        assert resp.status_code == 200, resp.text
        assert threads and all(t.startswith("rollfleet-tokenizer") for t in threads), threads


async def test_slow_connections_are_shed_at_the_header_deadline_while_good_requests_are_served():
    """300 connections that never finish their headers (slowloris) are closed at the deadline; a
    good request is served while they are open, and the connection cap answers 503 past it."""
    async with gateway({"header_timeout_s": 1.0}) as (server, http, _):
        host, port = server.url.removeprefix("http://").split(":")
        slow = [await asyncio.open_connection(host, int(port)) for _ in range(300)]
        for _, writer in slow:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        await still_serves(http)  # served while the 300 hang on
        loop = asyncio.get_running_loop()
        started = loop.time()
        closed = await asyncio.gather(*(closed_by_server(r) for r, _ in slow))
        assert all(closed) and loop.time() - started < 5.0
        await still_serves(http)
        for _, w in slow:
            w.close()
    async with gateway({"header_timeout_s": 1.0}) as (server, http, _):
        # One good request first, then half a request line: the deadline held for a connection's
        # first request only, so such a connection was never closed.
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode().lower()
        assert head.startswith("http/1.1 200")
        length = int(next(h for h in head.split("\r\n") if h.startswith("content-length")).split(":")[1])
        await reader.readexactly(length)
        await asyncio.sleep(1.5)  # longer than the deadline: only the next request's own is counted
        writer.write(b"GET /health HTTP/1.1\r\n")
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await closed_by_server(reader) and loop.time() - started < 5.0
        writer.close()
        await still_serves(http)
    async with gateway({"header_timeout_s": 1.0, "max_connections": 20}) as (server, http, _):
        host, port = server.url.removeprefix("http://").split(":")
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(25)]
        resp = await http.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 503  # over the cap: refused at once, not queued
        assert all(await asyncio.gather(*(closed_by_server(r) for r, _ in idle)))  # shed at the deadline
        await still_serves(http)
        for _, w in idle:
            w.close()
