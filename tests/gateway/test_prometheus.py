"""Scrape-config helpers: merge, atomic write, skip pseudo-addresses, reported errors; and a real
Prometheus (Debian package ``prometheus``) that loads the generated config and scrapes the gateway."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time

import httpx
import pytest
import yaml

from rollfleet.gateway.prometheus import (
    GATEWAY_JOB,
    PrometheusConfig,
    PrometheusConfigError,
    build_jobs,
    reload_prometheus,
    scrape_targets,
    update_prometheus_config,
    write_config_file,
)

PROMETHEUS_BIN = shutil.which("prometheus") or "/usr/bin/prometheus"
HAVE_PROMETHEUS = os.path.exists(PROMETHEUS_BIN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.unit
def test_only_http_addresses_become_targets():
    addresses = [
        "sim://replica-0",
        "vllm://not-started",
        "http://127.0.0.1:8001",
        "http://127.0.0.1:8001/",
        "10.0.0.2:9000",
        "https://h:443",
    ]
    assert scrape_targets(addresses) == {"http": ["127.0.0.1:8001", "10.0.0.2:9000"], "https": ["h:443"]}
    jobs = build_jobs(["sim://replica-0", "sim://replica-1"], "sim", gateway_address="127.0.0.1:8000")
    assert [j["job_name"] for j in jobs] == [GATEWAY_JOB]  # sim replicas have no /metrics of their own
    jobs = build_jobs(["http://127.0.0.1:8001"], "vllm", gateway_address="127.0.0.1:8000", scrape_interval="3s")
    assert jobs[0]["job_name"] == "rollfleet-vllm" and jobs[0]["static_configs"][0]["targets"] == ["127.0.0.1:8001"]
    assert all(j["scrape_interval"] == "3s" for j in jobs)
    (gateway,) = build_jobs([], gateway_address="https://gw:8443")  # scraped over TLS, as replicas are
    assert gateway["scheme"] == "https" and gateway["static_configs"] == [{"targets": ["gw:8443"]}]
    assert "scheme" not in build_jobs([], gateway_address="127.0.0.1:8000")[0]


@pytest.mark.unit
def test_update_merges_into_an_existing_file_atomically(tmp_path):
    path = tmp_path / "prometheus.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "15s"},
                "rule_files": ["rules.yml"],
                "scrape_configs": [
                    {"job_name": "node", "static_configs": [{"targets": ["localhost:9100"]}]},
                    {"job_name": "rollfleet-vllm", "static_configs": [{"targets": ["old:1"]}]},
                ],
            }
        )
    )
    cfg = PrometheusConfig(file=str(path), port=None)
    update_prometheus_config(
        cfg, ["http://127.0.0.1:8001", "http://127.0.0.1:8002"], "vllm", gateway_address="127.0.0.1:8000"
    )
    data = yaml.safe_load(path.read_text())
    assert data["global"] == {"scrape_interval": "15s"} and data["rule_files"] == ["rules.yml"]
    jobs = {j["job_name"]: j for j in data["scrape_configs"]}
    assert set(jobs) == {"node", "rollfleet-vllm", GATEWAY_JOB}
    assert jobs["rollfleet-vllm"]["static_configs"][0]["targets"] == ["127.0.0.1:8001", "127.0.0.1:8002"]
    # again, with one replica fewer: replaced, not appended
    update_prometheus_config(cfg, ["http://127.0.0.1:8001"], "vllm", gateway_address="127.0.0.1:8000")
    data = yaml.safe_load(path.read_text())
    assert [j["job_name"] for j in data["scrape_configs"]].count("rollfleet-vllm") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prometheus.yml"]  # no temporary files left


@pytest.mark.unit
def test_errors_are_reported_not_swallowed(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text("scrape_configs: [unclosed\n")
    with pytest.raises(PrometheusConfigError, match="not valid YAML"):
        update_prometheus_config(PrometheusConfig(file=str(broken), port=None), [], gateway_address="127.0.0.1:1")
    assert broken.read_text() == "scrape_configs: [unclosed\n"  # left as it was
    with pytest.raises(PrometheusConfigError, match="could not reach"):
        reload_prometheus(free_port())
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PrometheusConfigError, match="could not write"):
        write_config_file({"a": 1}, str(blocker / "sub" / "prometheus.yml"))


async def _wait_json(http: httpx.AsyncClient, url: str, pred, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            resp = await http.get(url)
            if resp.status_code == 200:
                last = resp.json()
                if pred(last):
                    return last
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out waiting on {url}; last answer: {last}")


@pytest.mark.ray
@pytest.mark.skipif(
    not HAVE_PROMETHEUS, reason=f"Prometheus binary not found at {PROMETHEUS_BIN} (apt-get install prometheus)"
)
async def test_a_real_prometheus_scrapes_the_gateway(stack, tmp_path):
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(
        yaml.safe_dump({"scrape_configs": [{"job_name": "keep-me", "static_configs": [{"targets": ["127.0.0.1:1"]}]}]})
    )
    gateway_address = stack.url.split("://", 1)[1]
    prom = PrometheusConfig(file=str(config_file), port=free_port(), scrape_interval="1s")
    replicas = [r.address for r in await stack.manager.get_replicas()]
    assert all(a.startswith("sim://") for a in replicas)
    update_prometheus_config(prom, replicas, "sim", gateway_address=gateway_address, reload=False)

    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(
        [
            PROMETHEUS_BIN,
            f"--config.file={config_file}",
            f"--web.listen-address=127.0.0.1:{prom.port}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            "--web.enable-lifecycle",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{prom.port}"
    try:
        async with httpx.AsyncClient(timeout=5) as http:

            def gateway_up(body) -> bool:
                return any(
                    t["labels"].get("job") == GATEWAY_JOB and t["health"] == "up" for t in body["data"]["activeTargets"]
                )

            body = await _wait_json(http, f"{base}/api/v1/targets", gateway_up)
            pools = {t["scrapePool"] for t in body["data"]["activeTargets"]}
            assert pools == {"keep-me", GATEWAY_JOB}
            target = next(t for t in body["data"]["activeTargets"] if t["scrapePool"] == GATEWAY_JOB)
            assert target["scrapeUrl"] == f"http://{gateway_address}/metrics"

            # the gateway's series are queryable
            await _wait_json(
                http,
                f"{base}/api/v1/query?query=rollfleet_replica_health_state",
                lambda b: len(b["data"]["result"]) > 0,
            )

            # a second update (one more job, as after a membership change) reaches it through /-/reload
            update_prometheus_config(
                prom, replicas + [f"http://{gateway_address}"], "sim", gateway_address=gateway_address, reload=True
            )
            await _wait_json(
                http,
                f"{base}/api/v1/targets",
                lambda b: (
                    {t["scrapePool"] for t in b["data"]["activeTargets"]} == {"keep-me", GATEWAY_JOB, "rollfleet-sim"}
                ),
            )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode is not None
