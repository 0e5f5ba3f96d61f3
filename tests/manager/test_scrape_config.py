"""The controller's scrape-config writer: writes only on a change of targets, follows replicas that
move, keeps other jobs, and never raises (monitoring must not stop the fleet); the config section
that turns it on."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import pydantic
import pytest
import yaml

from rollfleet.config import PrometheusSection, RolloutConfig
from rollfleet.manager import prometheus
from rollfleet.manager.prometheus import GATEWAY_JOB, PrometheusConfigError, ScrapeConfigWriter

pytestmark = pytest.mark.unit

JOB = "rollfleet-vllm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def writer(path, **kw) -> ScrapeConfigWriter:
    return ScrapeConfigWriter(PrometheusSection(enable=True, file=str(path), **kw), "vllm")


def jobs(path) -> dict[str, dict]:
    return {j["job_name"]: j for j in yaml.safe_load(path.read_text())["scrape_configs"]}


def targets(path, job: str = JOB) -> list[str]:
    return jobs(path)[job]["static_configs"][0]["targets"]


async def test_first_refresh_writes_the_replicas(tmp_path):
    path = tmp_path / "prom" / "prometheus.yml"
    w = writer(path, scrape_interval="3s")
    assert await w.refresh(["http://10.0.0.1:8001", "http://10.0.0.2:8001", "sim://replica-9"]) is True
    assert targets(path) == ["10.0.0.1:8001", "10.0.0.2:8001"]
    assert jobs(path)[JOB]["scrape_interval"] == "3s"
    assert w.writes == 1 and w.last_error is None


async def test_unchanged_targets_are_not_rewritten(tmp_path):
    path = tmp_path / "prometheus.yml"
    w = writer(path)
    assert await w.refresh(["http://10.0.0.1:8001", "http://10.0.0.2:8001"])
    path.write_text("# left alone\n")  # a rewrite would replace this
    # the same targets, in another order and spelling, plus a pseudo-address: nothing to write
    assert await w.refresh(["10.0.0.2:8001", "http://10.0.0.1:8001/", "sim://replica-0"]) is False
    assert path.read_text() == "# left alone\n"
    assert w.writes == 1


async def test_a_replica_that_moves_is_followed(tmp_path):
    path = tmp_path / "prometheus.yml"
    w = writer(path)
    await w.refresh(["http://10.0.0.1:8001", "http://10.0.0.2:8001"])
    # replica 1 restarted on another node and port
    assert await w.refresh(["http://10.0.0.1:8001", "http://10.0.0.3:9005"]) is True
    assert targets(path) == ["10.0.0.1:8001", "10.0.0.3:9005"]
    assert list(jobs(path)).count(JOB) == 1
    assert w.writes == 2


async def test_hand_written_and_gateway_jobs_are_kept_and_an_empty_fleet_drops_the_replica_job(tmp_path):
    path = tmp_path / "prometheus.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "15s"},
                "scrape_configs": [
                    {"job_name": "node", "static_configs": [{"targets": ["localhost:9100"]}]},
                    {"job_name": GATEWAY_JOB, "static_configs": [{"targets": ["127.0.0.1:8000"]}]},
                    {"job_name": JOB, "static_configs": [{"targets": ["stale:1"]}]},
                ],
            }
        )
    )
    w = writer(path)
    assert await w.refresh(["http://10.0.0.1:8001"])
    data = yaml.safe_load(path.read_text())
    assert data["global"] == {"scrape_interval": "15s"}
    assert set(jobs(path)) == {"node", GATEWAY_JOB, JOB}
    assert targets(path) == ["10.0.0.1:8001"] and targets(path, "node") == ["localhost:9100"]
    # every replica removed: the old targets disappear, the other jobs stay
    assert await w.refresh([]) is True
    assert set(jobs(path)) == {"node", GATEWAY_JOB}


async def test_an_unwritable_path_is_logged_and_remembered_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    w = writer(blocker / "sub" / "prometheus.yml")
    with caplog.at_level(logging.WARNING, logger="rollfleet.manager.prometheus"):
        assert await w.refresh(["http://10.0.0.1:8001"]) is False
    assert isinstance(w.last_error, PrometheusConfigError) and "could not write" in str(w.last_error)
    assert any("could not write" in r.getMessage() for r in caplog.records)
    assert w.writes == 0


async def test_scrape_configs_that_are_not_a_list_of_jobs_are_remembered_not_raised(tmp_path):
    """A mapping or a list of strings under scrape_configs was a bare AttributeError out of refresh,
    in a task nobody awaited: no warning, no last_error, the file never updated."""
    for text in ("scrape_configs:\n  job_name: node\n", "scrape_configs:\n  - node-exporter\n"):
        path = tmp_path / "prometheus.yml"
        path.write_text(text)
        w = writer(path)
        assert await w.refresh(["http://10.0.0.1:8001"]) is False
        assert isinstance(w.last_error, PrometheusConfigError) and "not a list of jobs" in str(w.last_error)
        assert path.read_text() == text  # not overwritten


async def test_a_failed_reload_is_remembered_and_the_file_still_written(tmp_path):
    path = tmp_path / "prometheus.yml"
    w = writer(path, port=free_port())  # nothing listens there
    assert await w.refresh(["http://10.0.0.1:8001"]) is True
    assert targets(path) == ["10.0.0.1:8001"]
    assert isinstance(w.last_error, PrometheusConfigError) and "could not reach" in str(w.last_error)


async def test_refreshes_never_interleave_and_the_newest_list_wins(tmp_path, monkeypatch):
    path = tmp_path / "prometheus.yml"
    w = writer(path)
    real_write = prometheus.write_config_file
    first_started, release = threading.Event(), threading.Event()
    in_flight, peak, count_lock = [0], [0], threading.Lock()

    def slow_write(data, config_path):
        with count_lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            if not first_started.is_set():  # hold the first write until the second refresh is queued
                first_started.set()
                release.wait(5)
            return real_write(data, config_path)
        finally:
            with count_lock:
                in_flight[0] -= 1

    monkeypatch.setattr(prometheus, "write_config_file", slow_write)
    old = asyncio.create_task(w.refresh(["http://10.0.0.1:8001"]))
    assert await asyncio.to_thread(first_started.wait, 5)
    new = asyncio.create_task(w.refresh(["http://10.0.0.2:8001"]))
    await asyncio.sleep(0.2)  # were refreshes not serialised, the newer one would write now
    release.set()
    await asyncio.gather(old, new)
    assert targets(path) == ["10.0.0.2:8001"]  # the slow, older refresh did not overwrite it
    assert peak[0] == 1 and w.last_error is None


async def test_a_disabled_section_writes_nothing(tmp_path):
    path = tmp_path / "prometheus.yml"
    w = ScrapeConfigWriter(PrometheusSection(enable=False, file=str(path)), "vllm")
    assert await w.refresh(["http://10.0.0.1:8001"]) is False
    assert not path.exists()


def test_enable_without_file_is_rejected_with_the_key_named():
    with pytest.raises(pydantic.ValidationError, match=r"rollout\.prometheus\.file"):
        PrometheusSection(enable=True)
    with pytest.raises(pydantic.ValidationError, match=r"rollout\.prometheus\.file"):
        RolloutConfig.model_validate({"prometheus": {"enable": True, "port": 9090}})
    with pytest.raises(pydantic.ValidationError):
        PrometheusSection(enable=True, file="/tmp/p.yml", port=0)
    assert RolloutConfig().prometheus.enable is False
