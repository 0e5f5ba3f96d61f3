"""The gateway's limits: what a caller cannot make it do (no Ray: one in-process sim replica).

Each limit answers in the OpenAI error shape naming the field and the config field, and the
gateway goes on serving a good request right after.
"""

from __future__ import annotations

import asyncio
import threading
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


async def gateway(server_options: Any = None, **limits: Any) -> tuple[GatewayServer, httpx.AsyncClient, Gateway]:
    server, gw, _ = await in_process_gateway(
        GatewayConfig(**limits), response_length=16, time_scale=1000.0, mean_response_tokens=8, **(server_options or {})
    )
    return server, httpx.AsyncClient(base_url=server.url, timeout=30), gw


async def still_serves(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200, resp.text


def assert_error(resp: httpx.Response, status: int, param: Any, *words: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert all(w in error["message"] for w in words), error["message"]


async def test_a_callers_chat_template_is_refused_unless_the_operator_allows_it():
    server, http, _ = await gateway()
    try:
        body = {**CHAT, "chat_template_kwargs": {"chat_template": NESTED_TEMPLATE}}
        resp = await http.post("/v1/chat/completions", json=body)
        assert_error(resp, 400, "chat_template_kwargs.chat_template", "allow_caller_chat_template")
        ok = await http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
        assert ok.status_code == 200, ok.text  # template parameters are still welcome
        await still_serves(http)
    finally:
        await http.aclose()
        await server.stop()
    server, http, _ = await gateway(allow_caller_chat_template=True)
    try:
        own = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"
        resp = await http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"chat_template": own}})
        assert resp.status_code == 200, resp.text
    finally:
        await http.aclose()
        await server.stop()


async def test_bodies_over_the_limit_are_refused_before_they_are_read():
    server, http, _ = await gateway(max_body_bytes=64 * 1024)
    try:
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
    finally:
        await http.aclose()
        await server.stop()


async def test_a_body_that_trickles_in_is_cut_off_at_the_body_timeout():
    server, http, _ = await gateway(body_timeout_s=0.5)
    try:
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
    finally:
        await http.aclose()
        await server.stop()


async def test_prompt_text_generations_and_session_ids_have_limits():
    server, http, gw = await gateway(max_prompt_chars=1000, max_generations=8, max_session_id_chars=16)
    encoded: list[int] = []
    encode = gw.codec.encode
    gw.codec.encode = lambda *a, **k: encoded.append(1) or encode(*a, **k)  # type: ignore[method-assign]
    try:
        long = {**CHAT, "messages": [{"role": "user", "content": "x" * 1001}]}
        assert_error(await http.post("/v1/chat/completions", json=long), 400, "messages", "gateway.max_prompt_chars")
        batch = {"model": MODEL, "prompt": ["a b c"] * 3, "n": 3, "max_tokens": 2}
        assert_error(await http.post("/v1/completions", json=batch), 400, "prompt", "9 generations", "max_generations")
        assert encoded == []  # neither reached the tokenizer
        resp = await http.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "s" * 17})
        assert_error(resp, 400, "x-session-id", "max_session_id_chars")
        resp = await http.post("/v1/chat/completions", json={**CHAT, "session_id": "s" * 17})
        assert_error(resp, 400, "session_id", "17 characters")
        await still_serves(http)
    finally:
        await http.aclose()
        await server.stop()


async def test_tokenizing_and_chat_templates_run_off_the_event_loop():
    server, http, gw = await gateway()
    threads: list[str] = []
    codec = gw.codec
    encode, render = codec.encode, codec.render_chat

    def spy(fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            threads.append(threading.current_thread().name)
            return fn(*a, **k)

        return wrapped

    codec.encode, codec.render_chat = spy(encode), spy(render)  # type: ignore[method-assign]
    try:
        await still_serves(http)
        resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "a long text", "max_tokens": 2})
        assert resp.status_code == 200, resp.text
        assert threads and all(t.startswith("rollfleet-tokenizer") for t in threads), threads
    finally:
        await http.aclose()
        await server.stop()


async def test_slow_connections_are_shed_at_the_header_deadline_while_good_requests_are_served():
    """300 connections that never finish their headers (slowloris) are closed at the deadline; a
    good request is served while they are open, and the connection cap answers 503 past it."""
    server, http, _ = await gateway({"header_timeout_s": 1.0})
    host, port = server.url.removeprefix("http://").split(":")
    slow = []
    try:
        for _ in range(300):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            slow.append((reader, writer))
        await still_serves(http)  # served while the 300 hang on
        loop = asyncio.get_running_loop()
        started = loop.time()
        closed = await asyncio.gather(*(asyncio.wait_for(r.read(), 10) for r, _ in slow))
        assert all(c == b"" for c in closed) and loop.time() - started < 5.0
        await still_serves(http)
    finally:
        for _, w in slow:
            w.close()
        await http.aclose()
        await server.stop()
    server, http, _ = await gateway({"header_timeout_s": 1.0, "max_connections": 20})
    host, port = server.url.removeprefix("http://").split(":")
    idle = []
    try:
        for _ in range(25):
            idle.append(await asyncio.open_connection(host, int(port)))
        resp = await http.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 503  # over the cap: refused at once, not queued
        await asyncio.gather(*(asyncio.wait_for(r.read(), 10) for r, _ in idle))  # shed at the deadline
        await still_serves(http)
    finally:
        for _, w in idle:
            w.close()
        await http.aclose()
        await server.stop()


async def test_a_prompt_that_cannot_fit_is_refused_before_the_tokenizer_runs():
    """A 10 MB prompt under raised body and text limits: refused from its length alone (no token
    is shorter than 1/max_token_chars of it), so the tokenizer, which holds the GIL, never runs."""
    server, http, gw = await gateway(max_body_bytes=64 << 20, max_prompt_chars=50_000_000)
    encoded: list[int] = []
    encode = gw.codec.encode
    gw.codec.encode = lambda *a, **k: encoded.append(1) or encode(*a, **k)  # type: ignore[method-assign]
    try:
        big = {"model": MODEL, "prompt": "word " * 2_000_000, "max_tokens": 2}
        resp = await http.post("/v1/completions", json=big)
        assert_error(resp, 400, "prompt", "at least 625000 tokens", "context is 512 tokens")
        chat = {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}
        assert_error(await http.post("/v1/chat/completions", json=chat), 400, "messages", "context is 512 tokens")
        assert encoded == []
        await still_serves(http)
    finally:
        await http.aclose()
        await server.stop()
