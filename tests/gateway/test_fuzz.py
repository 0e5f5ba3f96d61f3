"""The gateway under 5,000 generated requests: every one gets an answer (no hang), never a 5xx,
and a good request is served after them. Bodies are drawn by hypothesis from each route's fields with
values of every JSON type, out-of-range numbers, huge and empty strings and lists, unknown keys,
and caller templates.

The gateway runs in a thread of its own (its own event loop, one in-process sim replica), so that
hypothesis can drive it with plain blocking calls.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Iterator

import httpx
import pytest
from gateway_support import MODEL, in_process_gateway
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollfleet.config import GatewayConfig

pytestmark = pytest.mark.unit

#: About a minute on 2 cores; ``FUZZ_CASES`` to change it.
CASES = int(os.environ.get("FUZZ_CASES", 5000))

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 0.0, -0.0, 2**53 + 1]),
    st.text(max_size=40),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)  # fmt: skip
token_ids = st.lists(st.integers(min_value=-5, max_value=5000), max_size=40)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | values},
    optional={
        "content": st.text(max_size=200)
        | values
        | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | values, "text": values})),
        "name": values,
        "tool_calls": values,
    },
)
common = {
    "model": st.sampled_from([MODEL, MODEL, "gpt-4"]) | values,
    "max_tokens": st.integers(min_value=-3, max_value=10**6) | values,
    "temperature": st.floats(min_value=-1, max_value=5) | values,
    "top_p": st.floats(min_value=-1, max_value=2) | values,
    "top_k": st.integers(min_value=-3, max_value=100) | values,
    "n": st.integers(min_value=-1, max_value=40) | values,
    "seed": values,
    "stop": st.text(max_size=10) | st.lists(st.text(max_size=10), max_size=3) | values,
    "stop_token_ids": token_ids | values,
    "stream": st.booleans() | values,
    "logprobs": values,
    "session_id": st.text(max_size=300) | values,
    "user": values,
    "ignore_eos": values,
    "unknown_key": values,
}
bodies = st.one_of(
    st.tuples(
        st.just("/v1/completions"),
        st.fixed_dictionaries(
            {},
            optional={**common, "prompt": st.text(max_size=300) | token_ids | st.lists(token_ids, max_size=3) | values},
        ),
    ),
    st.tuples(
        st.just("/v1/chat/completions"),
        st.fixed_dictionaries(
            {},
            optional={
                **common,
                "messages": st.lists(message, max_size=4) | values,
                "chat_template_kwargs": st.dictionaries(st.sampled_from(["chat_template", "x"]), st.text(max_size=80))
                | values,
                "tools": values,
                "max_completion_tokens": values,
            },
        ),
    ),
    st.tuples(
        st.just("/v1/completions/tokens"),
        st.fixed_dictionaries({}, optional={**common, "prompt_token_ids": token_ids | values}),
    ),  # fmt: skip
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), values),  # not even an object
)


@pytest.fixture(scope="module")
def gateway_url() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[Any, Any]:
        server, _, replica = await in_process_gateway(
            GatewayConfig(request_timeout_s=10), response_length=8, time_scale=10_000.0, mean_response_tokens=4
        )
        return server, replica

    server, replica = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    yield server.url
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(60)
    asyncio.run_coroutine_threadsafe(replica.shutdown(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture(scope="module")
def http(gateway_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway_url, timeout=30) as client:
        yield client


@settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(case=bodies)
def test_no_generated_request_gets_a_5xx_or_hangs(http: httpx.Client, case: tuple[str, Any]) -> None:
    route, body = case
    resp = http.post(route, json=body)
    assert resp.status_code < 500, (route, body, resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert error["message"] and error["type"], error


def test_a_good_request_is_served_after_the_fuzzing(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text
