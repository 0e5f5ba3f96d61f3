"""Admin routes: off without a token, refused without the right one, and working with it —
including a weight update in the middle of requests, which callers never notice."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from gateway_support import MODEL, load_codec, stack_config

from rollfleet.gateway import GatewayStack

pytestmark = pytest.mark.ray

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
async def admin_stack(ray_session):
    # real time (1x): a 300-token answer takes ~2 s, long enough to be in flight during an update
    config = stack_config(time_scale=1.0, admin_token=TOKEN, max_body_bytes=64 * 1024)
    s = await GatewayStack.start(config, load_codec())
    yield s
    await s.stop()


@pytest.fixture
async def admin_http(admin_stack):
    async with httpx.AsyncClient(base_url=admin_stack.url, timeout=60) as client:
        yield client


async def test_admin_routes_are_off_without_a_configured_token(http):
    for method, path in (("GET", "/admin/status"), ("POST", "/admin/update_weights"), ("POST", "/admin/replicas/add")):
        resp = await http.request(method, path, json={})
        assert resp.status_code == 404
        assert resp.json()["error"]["type"] == "not_found_error"


async def test_admin_routes_refuse_missing_or_wrong_tokens(admin_http):
    resp = await admin_http.get("/admin/status")
    assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
    assert resp.json()["error"]["type"] == "authentication_error"
    for header in ("Bearer wrong", f"Basic {TOKEN}", "Bearer"):
        resp = await admin_http.post(
            "/admin/update_weights", json={"path": "/x", "version": 99}, headers={"Authorization": header}
        )
        assert resp.status_code == 403, header
        assert resp.json()["error"]["type"] == "permission_error"
    resp = await admin_http.get("/admin/status", headers=AUTH)
    assert resp.status_code == 200
    body = resp.json()
    assert body["fleet"]["current_version"] == 0 and len(body["fleet"]["replicas"]) == 2
    assert body["gateway"]["model"] == MODEL


async def test_add_and_remove_replicas(admin_http, admin_stack):
    listed = (await admin_http.get("/admin/replicas", headers=AUTH)).json()["replicas"]
    assert {r["state"] for r in listed} == {"healthy"} and len(listed) == 2
    resp = await admin_http.post("/admin/replicas/add", json={"num_replicas": 1}, headers=AUTH)
    assert resp.status_code == 200, resp.text
    new_id = resp.json()["added"][0]["replica_id"]
    assert len((await admin_http.get("/admin/replicas", headers=AUTH)).json()["replicas"]) == 3
    await admin_stack.gateway.service.client.fleet.refresh()
    assert new_id in admin_stack.gateway.service.client.balancer.get_all_servers()

    resp = await admin_http.post("/admin/replicas/remove", json={"replica_ids": ["replica-404"]}, headers=AUTH)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "replica_ids"
    resp = await admin_http.post(
        "/admin/replicas/remove", json={"replica_ids": [new_id], "drain_timeout_s": 5}, headers=AUTH
    )
    assert resp.status_code == 200 and resp.json()["removed"] == [new_id]
    assert len((await admin_http.get("/admin/replicas", headers=AUTH)).json()["replicas"]) == 2
    resp = await admin_http.post("/admin/replicas/add", json={"num_replicas": -1}, headers=AUTH)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "num_replicas"


async def test_weight_update_mid_request_is_resumed_inside_the_gateway(admin_http, admin_stack):
    async def long_request(i: int) -> dict:
        resp = await admin_http.post(
            "/v1/completions/tokens",
            json={"model": MODEL, "prompt_token_ids": [10 + i, 11, 12], "max_tokens": 300, "ignore_eos": True},
            headers={"X-Session-ID": f"long-{i}"},
        )
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]

    requests = asyncio.ensure_future(asyncio.gather(*(long_request(i) for i in range(12))))
    balancer = admin_stack.gateway.service.client.balancer
    for _ in range(400):  # all 12 routed to a replica (even on a busy machine) ...
        if balancer.get_total_inflight() == 12:
            break
        await asyncio.sleep(0.025)
    await asyncio.sleep(0.3)  # ... and generating there: 300 tokens take ~2 s at 1x
    bad = {"path": "/weights/step-1", "version": 1, "mode": "pause"}
    refused = await admin_http.post("/admin/update_weights", json=bad, headers=AUTH)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "mode"
    # abort mode: the requests are interrupted and resumed inside the gateway, invisibly
    body = {"path": "/weights/step-1", "version": 1, "mode": "abort"}
    resp = await admin_http.post("/admin/update_weights", json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert resp.json()["version"] == 1 and resp.json()["failed"] == []
    choices = await requests
    for c in choices:  # each caller got one whole answer: the full budget, no abort visible
        assert c["finish_reason"] == "length" and len(c["token_ids"]) == 300 == len(c["token_logprobs"])
    assert sum(c["num_resumes"] for c in choices) > 0
    assert any(c["min_weight_version"] == 0 and c["max_weight_version"] == 1 for c in choices)

    after = await admin_http.post(
        "/v1/completions/tokens", json={"model": MODEL, "prompt_token_ids": [1, 2], "max_tokens": 3}
    )
    assert after.json()["choices"][0]["min_weight_version"] == 1

    stale = await admin_http.post("/admin/update_weights", json={"path": "/weights/step-0", "version": 1}, headers=AUTH)
    assert stale.status_code == 409 and stale.json()["error"]["param"] == "version"
    missing = await admin_http.post("/admin/update_weights", json={"version": 2}, headers=AUTH)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "path"

    await asyncio.sleep(0.5)  # one status poll
    metrics = (await admin_http.get("/metrics")).text
    resumes = _value(metrics, "rollfleet_gateway_resumes_total")
    assert resumes == sum(c["num_resumes"] for c in choices)
    assert _value(metrics, "rollfleet_gateway_interrupted_requests_total") >= 1
    assert _value(metrics, 'rollfleet_replica_weight_version{replica="replica-0"}') == 1
    assert _value(metrics, "rollfleet_fleet_weight_version") == 1


async def test_profile_start_and_stop(admin_http, tmp_path):
    resp = await admin_http.post("/admin/profile/start", json={"trace_dir": str(tmp_path)}, headers=AUTH)
    assert resp.status_code == 200, resp.text
    await admin_http.post("/v1/completions/tokens", json={"model": MODEL, "prompt_token_ids": [1, 2], "max_tokens": 3})
    resp = await admin_http.post("/admin/profile/stop", headers=AUTH)
    assert resp.status_code == 200, resp.text
    traces = resp.json()["traces"]
    assert len(traces) == 2 and all(str(p).startswith(str(tmp_path)) for p in traces.values())


async def test_a_bad_profile_option_is_a_400_naming_it(admin_http, tmp_path):
    resp = await admin_http.post("/admin/profile/start", json={"trace_dri": str(tmp_path)}, headers=AUTH)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "trace_dri" and "did you mean 'trace_dir'" in error["message"], error
    assert error["message"].startswith("invalid request: field 'trace_dri'"), error  # not Ray's remote traceback
    traces = (await admin_http.post("/admin/profile/stop", headers=AUTH)).json()["traces"]
    assert traces and all(t is None for t in traces.values()), traces  # the refused call started none


async def test_admin_bodies_are_read_within_the_gateway_body_limit(admin_http):
    """A token holder's body is bounded like anyone's: refused before it is read."""
    big = {"path": "/x" + "y" * (64 * 1024), "version": 99}
    resp = await admin_http.post("/admin/update_weights", json=big, headers=AUTH)
    assert resp.status_code == 413, resp.text
    assert "gateway.max_body_bytes" in resp.json()["error"]["message"]
    resp = await admin_http.get("/admin/status", headers=AUTH)
    assert resp.status_code == 200 and resp.json()["fleet"]["current_version"] < 99


def _value(metrics_text: str, series: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not in /metrics")
