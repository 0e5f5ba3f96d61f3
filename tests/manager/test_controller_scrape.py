"""The controller keeps the Prometheus scrape config in step with the fleet: at launch, on add and
remove, and after a restart moves a replica to a new address."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import yaml

from rollfleet.config import RolloutConfig, SimEngineConfig
from rollfleet.engines.sim import SimEngine
from rollfleet.manager.controller import FleetController
from rollfleet.server.local import LocalHandle
from rollfleet.server.replica import Replica

pytestmark = pytest.mark.unit

PORTS = itertools.count(9100)


class HttpSim(SimEngine):
    """A sim engine that reports an HTTP address, a new port on every start (as a restarted vLLM)."""

    def address(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    async def start(self) -> None:
        self._port = next(PORTS)
        await super().start()


def targets(path) -> list[str]:
    jobs = {j["job_name"]: j for j in yaml.safe_load(path.read_text())["scrape_configs"]}
    job = jobs.get("rollfleet-sim")
    return sorted(job["static_configs"][0]["targets"]) if job else []


async def until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met")


async def test_scrape_config_follows_launch_add_remove_and_restart(tmp_path):
    path = tmp_path / "prometheus.yml"
    cfg = RolloutConfig(
        name="sim",
        prompt_length=16,
        response_length=8,
        max_model_len=64,
        sim=SimEngineConfig(vocab_size=300, time_scale=1000.0),
        prometheus={"enable": True, "file": str(path)},
        health={"probe_interval_s": 0.05, "probe_timeout_s": 0.5, "failures_to_dead": 1},
    )
    replicas: dict[str, Replica] = {}

    def make(replica_id: str, index: int) -> LocalHandle:
        replicas[replica_id] = Replica(replica_id, cfg, index, engine=HttpSim(cfg.sim))
        return LocalHandle(replicas[replica_id])

    controller = FleetController(cfg, replica_factory=make)
    await controller.launch(2)
    await until(lambda: path.exists() and len(targets(path)) == 2)
    first = targets(path)
    await controller.add_replicas(1)
    await until(lambda: len(targets(path)) == 3)
    await controller.remove_replicas(["replica-0"], drain_timeout_s=1.0)
    await until(lambda: len(targets(path)) == 2 and first[0] not in targets(path))
    before = targets(path)
    old = replicas["replica-1"].engine.address().split("://")[1]
    replicas["replica-1"].engine.inject_fault("crash")  # dies; the controller restarts it elsewhere
    await until(lambda: replicas["replica-1"].engine.address().split("://")[1] != old and old not in targets(path), 10)
    assert len(targets(path)) == 2 and targets(path) != before
    await controller.shutdown()
