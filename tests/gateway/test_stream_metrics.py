"""A streamed answer is counted and timed when its body has been sent: its handler returns before
a token is sampled, and the latency taken then was the time to its headers."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from gateway_support import MODEL, slow_gateway
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.unit

ROUTE = "/v1/completions"


def latency(text: str) -> tuple[float, float]:
    """(sum, count) of the route's request latency."""
    got = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("route") == ROUTE and s.name.startswith("rollfleet_gateway_request_latency_seconds_"):
                got[s.name.rsplit("_", 1)[1]] = s.value
    return got.get("sum", 0.0), got.get("count", 0.0)


def requests(text: str, status: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "rollfleet_gateway_requests_total" and s.labels == {"route": ROUTE, "status": status}:
                return s.value
    return 0.0


async def test_a_stream_is_timed_to_its_end_and_one_its_caller_left_is_counted_as_such():
    body = {"model": MODEL, "prompt": "count 1 2 3", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with slow_gateway() as (server, gw, replica):
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            before = latency((await http.get("/metrics")).text)
            started = time.perf_counter()
            async with http.stream("POST", ROUTE, json=body) as resp:
                async for _ in resp.aiter_bytes():
                    pass
            took = time.perf_counter() - started
            after = latency((await http.get("/metrics")).text)
            assert after[1] == before[1] + 1
            assert took > 0.2 and after[0] - before[0] >= 0.5 * took  # it was 16 ms of a 2.8 s stream
            async with http.stream("POST", ROUTE, json=body) as resp:  # left after its first chunk
                async for _ in resp.aiter_bytes():
                    break
            for _ in range(100):
                text = (await http.get("/metrics")).text
                if requests(text, "499") == 1:
                    break
                await asyncio.sleep(0.05)
            assert requests(text, "499") == 1 and requests(text, "200") == 1
