"""``/metrics``: the gateway's own registry, with request, token, routing and fleet-health series."""

from __future__ import annotations

import asyncio

import pytest
from gateway_support import MODEL
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.ray


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics[(name, tuple(sorted(labels.items())))]


async def test_metrics_cover_requests_tokens_routing_and_fleet_health(oai, http, stack):
    before = samples((await http.get("/metrics")).text)

    async def session(i: int) -> None:
        # a first message of several KV blocks: later turns share them whatever the answers were
        messages = [{"role": "user", "content": f"metrics session {i}: " + "tell me more about it " * 12}]
        for _ in range(3):
            resp = await oai.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, extra_headers={"X-Session-ID": f"m-{i}"}
            )
            messages += [
                {"role": "assistant", "content": resp.choices[0].message.content},
                {"role": "user", "content": "more"},
            ]

    await asyncio.gather(*(session(i) for i in range(6)))
    bad = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400
    await asyncio.sleep(0.5)  # a status poll
    resp = await http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    m = samples(resp.text)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return m[key] - before.get(key, 0.0)

    chat = "/v1/chat/completions"
    assert delta("rollfleet_gateway_requests_total", route=chat, status="200") == 18
    assert delta("rollfleet_gateway_requests_total", route="/v1/completions", status="400") == 1
    assert delta("rollfleet_gateway_request_latency_seconds_count", route=chat) == 18
    assert delta("rollfleet_gateway_request_latency_seconds_bucket", route=chat, le="+Inf") == 18
    assert delta("rollfleet_gateway_prompt_tokens_total", route=chat) > 18 * 5
    assert 18 <= delta("rollfleet_gateway_completion_tokens_total", route=chat) <= 18 * 6

    policy = "least_tokens"
    assert delta("rollfleet_gateway_routing_decisions_total", policy=policy, reason="sticky") >= 12
    assert delta("rollfleet_gateway_routing_decisions_total", policy=policy, reason="least_loaded") >= 6
    for reason in ("spill_over", "sticky_invalidated", "version_floor", "version_regressed"):
        assert ("rollfleet_gateway_routing_decisions_total", (("policy", policy), ("reason", reason))) in m
    assert 0 < value(m, "rollfleet_gateway_prefix_cache_hit_estimate") <= 1
    assert value(m, "rollfleet_gateway_resumes_total") == 0  # no weight update on this fleet

    for rid in ("replica-0", "replica-1"):
        assert value(m, "rollfleet_gateway_replica_inflight", replica=rid) == 0
        assert value(m, "rollfleet_replica_health_state", replica=rid, state="healthy") == 1
        assert value(m, "rollfleet_replica_health_state", replica=rid, state="dead") == 0
        assert value(m, "rollfleet_replica_weight_version", replica=rid) == 0
        assert 0 < value(m, "rollfleet_replica_prefix_cache_hit_rate", replica=rid) <= 1
    assert value(m, "rollfleet_gateway_fleet_status_age_seconds") < 5

    # its own registry: nothing of the gateway leaks into the process-global one
    assert not any(name.startswith("rollfleet_gateway") for name in REGISTRY._names_to_collectors)


async def test_inflight_per_replica_is_visible_while_requests_run(http, stack):
    replicas = [r.replica_id for r in await stack.manager.get_replicas()]
    for rid in replicas:  # slow the engines down so the requests are surely in flight when we look
        await stack.manager.inject_fault(rid, "slow", 20.0)
    tasks = [
        asyncio.ensure_future(
            http.post(
                "/v1/completions/tokens",
                json={"model": MODEL, "prompt_token_ids": [7, 8, i], "max_tokens": 400, "ignore_eos": True},
            )
        )
        for i in range(6)
    ]
    seen = 0.0
    while seen < 1 and not all(t.done() for t in tasks):
        m = samples((await http.get("/metrics")).text)
        seen = sum(v for (name, _), v in m.items() if name == "rollfleet_gateway_replica_inflight")
    try:
        await asyncio.gather(*tasks)
    finally:
        for rid in replicas:
            await stack.manager.inject_fault(rid, "none")
    assert seen >= 1
