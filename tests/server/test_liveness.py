"""The liveness probe of a replica whose engine is slow: busy is not dead, silent is."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rollfleet.engines.base import EngineHealth, EngineLoad
from rollfleet.errors import ReplicaUnavailable
from rollfleet.server.liveness import EngineLiveness

pytestmark = pytest.mark.unit

PROBE_TIMEOUT_S = 1.0


class SlowEngine:
    """Answers load and health after ``delay_s`` (None: never, like a SIGSTOPped server)."""

    def __init__(self) -> None:
        self.delay_s: Any = 0.0
        self.health_delay_s: Any = None  # None: as slow as load
        self.healthy = True
        self.running = 3

    @staticmethod
    async def _wait(delay_s: Any) -> None:
        if delay_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(delay_s)

    async def load(self) -> EngineLoad:
        await self._wait(self.delay_s)
        return EngineLoad(running=self.running)

    async def health(self) -> EngineHealth:
        await self._wait(self.delay_s if self.health_delay_s is None else self.health_delay_s)
        return EngineHealth(self.healthy, "ok" if self.healthy else "server gone")


async def timed_poll(probe: EngineLiveness) -> tuple[Any, float]:
    started = time.monotonic()
    try:
        result: Any = await probe.poll()
    except ReplicaUnavailable as exc:
        result = exc
    return result, time.monotonic() - started


async def test_a_starved_engine_is_reported_busy_within_the_probe_budget():
    engine = SlowEngine()
    probe = EngineLiveness("r0", engine, PROBE_TIMEOUT_S, busy_grace_s=30.0)  # type: ignore[arg-type]
    load, _ = await timed_poll(probe)
    assert load.running == 3
    # The engine answers after 5 s, far later than any probe waits. The probe returns on its own
    # budget (0.6 s here); the bound below is loose so that a loaded machine cannot fail it, yet far
    # under the engine's 5 s, which is what the probe must not wait for.
    engine.delay_s, engine.running = 5.0, 7
    load, took = await timed_poll(probe)
    assert load.running == 3  # the last known load: the engine answered recently
    assert took < 2.5, took
    probe.busy_grace_s = 0.0  # now it has been silent too long
    err, took = await timed_poll(probe)
    assert isinstance(err, ReplicaUnavailable) and "silent" in err.reason
    assert took < 2.5, took


async def test_an_engine_that_answers_unhealthy_fails_at_once_and_a_hung_one_after_its_silence():
    engine = SlowEngine()
    probe = EngineLiveness("r0", engine, PROBE_TIMEOUT_S, busy_grace_s=30.0)  # type: ignore[arg-type]
    engine.delay_s, engine.health_delay_s = 0.5, 0.0  # load times out (0.3 s); health answers at once
    engine.healthy = False
    err, _ = await timed_poll(probe)
    assert isinstance(err, ReplicaUnavailable) and "server gone" in err.reason
    engine.delay_s, engine.health_delay_s, engine.healthy = None, None, True  # hung from now on
    probe.busy_grace_s = 1.0
    assert not isinstance((await timed_poll(probe))[0], ReplicaUnavailable)  # answered < 1 s ago
    await asyncio.sleep(1.0)
    err, took = await timed_poll(probe)
    assert isinstance(err, ReplicaUnavailable) and "silent" in err.reason and took < PROBE_TIMEOUT_S


def test_a_hung_engine_of_a_simulated_fleet_is_found_out_in_virtual_time():
    """The probe measured silence on the host's clock, which hardly moves while a virtual fleet
    runs: a hung sim replica was reported alive at 580 simulated seconds (busy_grace_s 30)."""
    from rollfleet.config import RolloutConfig, SimEngineConfig
    from rollfleet.server.replica import Replica
    from rollfleet.utils import virtual_time

    async def main() -> float:
        cfg = RolloutConfig(
            name="sim", prompt_length=64, response_length=32, sim=SimEngineConfig(vocab_size=500, time_scale=1.0)
        )
        replica = Replica("r0", cfg, 0)
        await replica.start(version=0)
        await replica.inject_fault("hang")
        loop = asyncio.get_running_loop()
        try:
            for _ in range(60):
                try:
                    await replica.load()
                except ReplicaUnavailable:
                    return loop.time()
                await asyncio.sleep(10)
            return -1.0
        finally:
            await replica.shutdown()

    found = virtual_time.run(main())
    assert 30 <= found <= 60, found
