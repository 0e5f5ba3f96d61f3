"""Control operations that tolerate faults: a dead or hung replica is fenced and restarted, and the
operation stands on the others; a restart that fails is tried again.

The controller runs in-process over sim replicas (no Ray): what is under test is its fan-out and
its restart loop, with faults injected exactly where a real replica would fail.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rollfleet.config import HealthConfig, RolloutConfig, SimEngineConfig, WeightSyncConfig
from rollfleet.engines import build_engine
from rollfleet.errors import FleetOperationFailed, InvalidRequest, ReplicaUnavailable
from rollfleet.health import HealthState
from rollfleet.manager.controller import FleetController
from rollfleet.server.local import LocalHandle
from rollfleet.server.replica import Replica

pytestmark = pytest.mark.unit

COMMIT_TIMEOUT_S = 0.5
#: The hung-replica test's timeout: long enough that a stall of this host (0.35 s seen in CI) is
#: far from it, so the gap it checks in the other replica's stream tells a blocked fan-out from noise.
HUNG_TIMEOUT_S = 1.5
HOOKED = ("stage_weights", "commit_weights", "pause", "resume", "load", "weights_checksum")


def config(commit_timeout_s: float = COMMIT_TIMEOUT_S, **health: Any) -> RolloutConfig:
    health.setdefault("control_timeout_s", commit_timeout_s)
    return RolloutConfig(
        name="sim",
        prompt_length=16,
        response_length=64,
        max_model_len=128,
        sim=SimEngineConfig(vocab_size=300, eos_token_id=299, time_scale=50.0),
        health=HealthConfig(
            **{"probe_interval_s": 0.05, "probe_timeout_s": 0.2, "failures_to_dead": 2, "restart_backoff_s": 0.05}
            | health
        ),
        weight_sync=WeightSyncConfig(mode="keep", commit_timeout_s=commit_timeout_s),
    )


class Faults:
    """Which replica fails how; read by the factory and by the patched replica methods."""

    def __init__(self) -> None:
        self.dead: set[str] = set()  # every call raises, as a dead actor's would
        self.dead_actors: list[Replica] = []  # the same for these actors only (not their restarts)
        self.hung: set[str] = set()  # control calls never return (a SIGSTOPped process)
        self.hung_methods: set[str] = set(HOOKED)  # which calls hang on a hung replica
        self.failed_starts: dict[str, int] = {}  # replica id -> starts that fail before one succeeds
        self.crash_after_start: set[str] = set()  # every actor of these dies right after it starts
        self.starts: dict[str, int] = {}


def fleet(cfg: RolloutConfig, faults: Faults) -> tuple[FleetController, dict[str, Replica]]:
    replicas: dict[str, Replica] = {}

    def make(replica_id: str, index: int) -> LocalHandle:
        replica = Replica(replica_id, cfg, index, engine=build_engine(cfg, index))
        boot = replica.start

        async def start(*args: Any, **kwargs: Any) -> Any:
            faults.starts[replica_id] = faults.starts.get(replica_id, 0) + 1
            if faults.failed_starts.get(replica_id, 0) > 0:
                faults.failed_starts[replica_id] -= 1
                raise RuntimeError(f"{replica_id}: engine failed to start (injected)")
            started = await boot(*args, **kwargs)
            if replica_id in faults.crash_after_start:
                faults.dead_actors.append(replica)  # its first probe finds it dead
            return started

        replica.start = start  # type: ignore[method-assign]
        for name in HOOKED:
            original = getattr(replica, name)

            async def faulty(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                current = replicas.get(replica_id) is replica
                if (replica_id in faults.dead and current) or any(replica is r for r in faults.dead_actors):
                    raise ReplicaUnavailable(replica_id, "actor died (injected)")
                if current and replica_id in faults.hung and _name in faults.hung_methods:
                    await asyncio.Event().wait()
                return await _original(*args, **kwargs)

            setattr(replica, name, faulty)
        replicas[replica_id] = replica
        return LocalHandle(replica)

    return FleetController(cfg, replica_factory=make), replicas


async def wait_until(predicate: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"not reached within {timeout_s}s: {what}"
        await asyncio.sleep(0.02)


async def serving_on(controller: FleetController, rid: str, version: int) -> bool:
    snapshot = await controller.snapshot()
    return rid in snapshot.routable_ids() and snapshot.versions[rid] == version


async def test_an_update_while_a_replica_is_dead_completes_on_the_others_and_it_returns_on_the_new_version():
    faults = Faults()
    controller, replicas = fleet(config(), faults)
    await controller.launch(3)
    faults.dead_actors.append(replicas["replica-1"])  # died a moment ago: no probe has noticed yet
    result = await controller.update_weights({"step": 1}, 1)
    assert result["failed"] == ["replica-1"] and "actor died" in result["fenced"]["replica-1"]
    assert controller.current_version == 1
    snapshot = await controller.snapshot()  # its restart may be back already, never on version 0
    assert {"replica-0", "replica-2"} <= set(snapshot.routable_ids())
    assert {snapshot.versions[rid] for rid in snapshot.routable_ids()} == {1}
    await wait_until(lambda: serving_on(controller, "replica-1", 1), "replica-1 back on version 1")
    out = await replicas["replica-1"].generate("r", [1, 2, 3], {"max_tokens": 4})
    assert out.token_versions == [1] * len(out.token_ids)
    assert faults.starts["replica-1"] == 2
    await controller.shutdown()


@pytest.mark.parametrize(
    "hang, why",
    [
        ("commit_weights", "took over"),  # its engine is stuck loading; the actor still answers probes
        (HOOKED, "abandoned: dead (probe failed"),  # SIGSTOP: nothing answers; the prober sees it first
    ],
)
async def test_an_update_with_a_hung_replica_ends_in_time_and_the_rest_keeps_generating(hang, why):
    faults = Faults()
    faults.hung_methods = {hang} if isinstance(hang, str) else set(hang)
    controller, replicas = fleet(config(HUNG_TIMEOUT_S, auto_restart=False), faults)
    await controller.launch(2)
    stamps: list[float] = []
    stop = asyncio.Event()

    async def generate_on_replica_0() -> None:
        i = 0
        while not stop.is_set():
            await replicas["replica-0"].generate(f"g{i}", [1, 2, 3], {"max_tokens": 4})
            stamps.append(time.monotonic())
            i += 1

    gen = asyncio.ensure_future(generate_on_replica_0())
    await asyncio.sleep(0.2)
    faults.hung.add("replica-1")
    started = time.monotonic()
    result = await controller.update_weights({"step": 1}, 1)
    took = time.monotonic() - started
    await asyncio.sleep(0.2)
    stop.set()
    await gen
    assert took < HUNG_TIMEOUT_S + 1.0, took
    assert result["failed"] == ["replica-1"] and why in result["fenced"]["replica-1"], result["fenced"]
    assert (await controller.snapshot()).routable_ids() == ["replica-0"]
    window = [t for t in stamps if started - 0.1 <= t <= started + took + 0.1]
    gaps = [b - a for a, b in zip(window, window[1:])]
    assert len(window) > 5 and max(gaps) < HUNG_TIMEOUT_S / 2, (len(window), max(gaps, default=None))
    await controller.shutdown()


async def test_pause_with_a_hung_replica_fences_it_and_pauses_the_others_in_time():
    faults = Faults()
    # Its engine is stuck pausing while the actor still answers probes, so the pause's own timeout
    # fences it. (With every call hung, the prober's two failed probes, ~0.45 s, and the pause's
    # 0.5 s timeout race; either fences it: the update test above covers the prober's way.)
    faults.hung_methods = {"pause"}
    controller, replicas = fleet(config(auto_restart=False), faults)
    await controller.launch(2)
    faults.hung.add("replica-0")
    started = time.monotonic()
    report = await controller.pause()
    assert time.monotonic() - started < COMMIT_TIMEOUT_S + 1.0
    assert report["ok"] == ["replica-1"] and "took over" in report["fenced"]["replica-0"]
    status = await controller.status()
    assert status.replicas["replica-0"].state == "dead" and "pause failed" in status.replicas["replica-0"].detail
    assert (await controller.resume())["ok"] == ["replica-1"]  # the fenced one is no longer asked
    faults.hung.add("replica-1")
    with pytest.raises(FleetOperationFailed) as err:  # nobody could do it: that is an error
        await controller.pause()
    assert set(err.value.failures) == {"replica-1"}
    await controller.shutdown()


async def test_an_update_no_replica_could_take_raises_and_keeps_the_old_version():
    faults = Faults()
    controller, _ = fleet(config(auto_restart=False), faults)
    await controller.launch(2)
    faults.dead.update({"replica-0", "replica-1"})
    with pytest.raises(FleetOperationFailed) as err:
        await controller.update_weights({"step": 1}, 1)
    assert set(err.value.failures) == {"replica-0", "replica-1"}
    assert controller.current_version == 0
    await controller.shutdown()


async def test_one_replica_refusing_the_weights_is_fenced_and_the_update_goes_on_without_it():
    """A ValueError from one replica's staging (a stage folder it cannot write) was taken for the
    caller's mistake: the update raised, nothing was fenced, and every update after it failed alike.
    Refused by every replica, the weights are the caller's to fix: raised, nothing fenced."""
    controller, replicas = fleet(config(), Faults())
    await controller.launch(3)

    async def refuse(weights: Any, version: int) -> None:
        raise ValueError("stage folder not writable on this node")

    replicas["replica-1"].engine.stage_weights = refuse  # type: ignore[method-assign]
    result = await controller.update_weights({"step": 1}, 1)
    assert result["failed"] == ["replica-1"] and "not writable" in result["fenced"]["replica-1"]
    assert controller.current_version == 1
    await wait_until(lambda: serving_on(controller, "replica-1", 1), "replica-1 back on version 1")
    for replica in replicas.values():
        replica.engine.stage_weights = refuse  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="not writable"):
        await controller.update_weights({"step": 2}, 2)
    assert controller.current_version == 1
    assert all(r.state == HealthState.HEALTHY for r in controller._records.values())
    await controller.shutdown()


async def test_a_negative_replica_count_and_a_version_that_is_no_integer_are_refused_naming_the_field():
    """``add_replicas(-1)`` was accepted and stepped the next id back: the next add started a second
    actor as ``replica-1``, leaving the first running unowned. A version of 1.5 or True was
    published and stamped on every token; "2" or None failed on a bare comparison."""
    controller, replicas = fleet(config(), Faults())
    await controller.launch(2)
    with pytest.raises(InvalidRequest) as err:
        await controller.add_replicas(-1)
    assert err.value.field == "add_replicas(n)"
    assert [info.replica_id for info in await controller.add_replicas(1)] == ["replica-2"]
    for bad in ("2", 1.5, True, None):
        with pytest.raises(InvalidRequest) as err:
            await controller.update_weights({"step": 1}, bad)  # type: ignore[arg-type]
        assert err.value.field == "version", bad
    assert controller.current_version == 0
    await controller.shutdown()


async def test_a_rolling_wave_counts_replicas_already_down_against_max_unavailable():
    """Six replicas, half may be unavailable at once, two died just before the update: a wave was
    half of the four left (two), so four were out of service at once."""
    cfg = config().model_copy(
        update={
            "weight_sync": WeightSyncConfig(mode="rolling", max_unavailable=0.5, commit_timeout_s=2.0),
            "sim": SimEngineConfig(vocab_size=300, eos_token_id=299, time_scale=50.0, weight_load_ms=500.0),
        }
    )
    faults = Faults()
    controller, replicas = fleet(cfg, faults)
    await controller.launch(6)
    faults.dead_actors += [replicas["replica-4"], replicas["replica-5"]]  # no probe has noticed yet
    committing: set[str] = set()
    worst: list[int] = [0]
    for rid, replica in list(replicas.items()):
        commit = replica.commit_weights

        async def counted(*args: Any, _commit: Any = commit, _rid: str = rid, **kwargs: Any) -> Any:
            committing.add(_rid)
            down = {r for r, rec in controller._records.items() if rec.state not in ("healthy", "suspect")}
            worst[0] = max(worst[0], len(committing | down))
            try:
                return await _commit(*args, **kwargs)
            finally:
                committing.discard(_rid)

        replica.commit_weights = counted  # type: ignore[method-assign]
    result = await controller.update_weights({"step": 1}, 1)
    assert result["failed"] == ["replica-4", "replica-5"]
    assert worst[0] == 3
    await controller.shutdown()


async def test_a_restart_that_fails_twice_succeeds_on_the_third_try_and_status_says_why_meanwhile():
    faults = Faults()
    controller, _ = fleet(config(restart_backoff_s=0.3), faults)
    await controller.launch(2)
    faults.failed_starts["replica-1"] = 2
    faults.dead.add("replica-1")
    await controller.update_weights({"step": 1}, 1)  # fences replica-1
    faults.dead.clear()

    async def pending() -> bool:
        return (await controller.status()).replicas["replica-1"].state == "pending"

    await wait_until(pending, "replica-1 pending after a failed restart")
    detail = (await controller.status()).replicas["replica-1"].detail
    assert "restart try 1 failed" in detail and "failed to start (injected)" in detail and "next try" in detail
    await wait_until(lambda: serving_on(controller, "replica-1", 1), "replica-1 back on version 1")
    assert faults.starts["replica-1"] == 4  # the first start, two failed restarts, the one that worked
    await controller.shutdown()


async def test_a_restart_gives_up_after_max_restart_attempts_and_says_so():
    faults = Faults()
    controller, _ = fleet(config(restart_backoff_s=0.05, max_restart_attempts=2), faults)
    await controller.launch(2)
    faults.failed_starts["replica-0"] = 10
    faults.dead.add("replica-0")
    await controller.pause()
    faults.dead.clear()

    async def gave_up() -> bool:
        r = (await controller.status()).replicas["replica-0"]
        return r.state == "dead" and "gave up after 2 restart tries" in r.detail

    await wait_until(gave_up, "replica-0 given up after 2 tries")
    assert faults.starts["replica-0"] == 3
    await controller.shutdown()


async def test_a_replica_that_dies_right_after_each_start_backs_off_and_is_given_up():
    """It started, then crashed at once (out of memory on its first batch, a bad checkpoint): each
    restart counted as a success, so it was restarted at once, for ever, with no backoff and no
    limit. Quick deaths now back off as failed starts do, and count against max_restart_attempts."""
    faults = Faults()
    controller, replicas = fleet(config(restart_backoff_s=0.1, max_restart_attempts=3), faults)
    await controller.launch(2)
    faults.crash_after_start.add("replica-1")
    faults.dead_actors.append(replicas["replica-1"])  # the first crash

    async def backing_off() -> bool:
        return (
            "after restart #1 (1 in a row); next start in 0.1s"
            in (await controller.status()).replicas["replica-1"].detail
        )

    await wait_until(backing_off, "replica-1 backing off after dying right after its restart")

    async def gave_up() -> bool:
        r = (await controller.status()).replicas["replica-1"]
        return r.state == "dead" and "of 3 restarts in a row" in r.detail

    await wait_until(gave_up, "replica-1 given up after dying right after 3 restarts")
    assert faults.starts["replica-1"] == 4  # the first start, then three restarts, each dead at once
    await asyncio.sleep(0.5)
    assert faults.starts["replica-1"] == 4  # and no more
    assert "replica-0" in (await controller.snapshot()).routable_ids()
    await controller.shutdown()


async def test_every_replica_timing_out_at_once_is_a_stall_not_a_fleet_death_until_the_silence_is_long():
    """A host whose CPU-bound engines starve every process makes all probes time out in the same
    rounds: the replicas turn suspect, not dead, and serve again when it passes. Silence past
    ``health.busy_grace_s`` still kills (a fleet that really hangs is restarted)."""
    faults = Faults()
    faults.hung_methods = {"load"}
    controller, _ = fleet(config(busy_grace_s=1.5, auto_restart=False), faults)
    await controller.launch(2)
    faults.hung.update({"replica-0", "replica-1"})
    await asyncio.sleep(0.8)  # ~3 rounds of 0.25 s, each a timeout on both: past failures_to_dead=2
    status = await controller.status()
    assert {r.state for r in status.replicas.values()} == {"suspect"}, status.replicas
    assert all(r.consecutive_failures >= 2 for r in status.replicas.values())
    assert "with every replica at once" in status.replicas["replica-0"].detail
    faults.hung.clear()
    await wait_until(lambda: both_healthy(controller), "both healthy after the stall")
    faults.hung.update({"replica-0", "replica-1"})

    async def both_dead() -> bool:
        return {r.state for r in (await controller.status()).replicas.values()} == {"dead"}

    await wait_until(both_dead, "dead after busy_grace_s of silence", timeout_s=5.0)
    await controller.shutdown()


async def both_healthy(controller: FleetController) -> bool:
    return {r.state for r in (await controller.status()).replicas.values()} == {"healthy"}


async def test_one_replica_timing_out_while_the_other_answers_is_declared_dead():
    faults = Faults()
    faults.hung_methods = {"load"}
    controller, _ = fleet(config(busy_grace_s=60.0, auto_restart=False), faults)
    await controller.launch(2)
    faults.hung.add("replica-1")

    async def dead() -> bool:
        return (await controller.status()).replicas["replica-1"].state == "dead"

    await wait_until(dead, "replica-1 dead after failures_to_dead timeouts", timeout_s=2.0)
    assert (await controller.status()).replicas["replica-0"].state == "healthy"
    await controller.shutdown()


async def test_failures_reported_by_many_clients_at_once_count_as_one_probe():
    """Twenty clients see the same replica fail at once: one probe goes out, one failure counts
    (it was three concurrent probes' worth, enough to kill a replica that was merely slow)."""
    faults = Faults()
    controller, _ = fleet(config(probe_interval_s=3600.0), faults)
    await controller.launch(2)
    faults.dead.add("replica-0")
    await asyncio.gather(*(controller.report_failure("replica-0", "connection reset") for _ in range(20)))
    record = (await controller.status()).replicas["replica-0"]
    assert (record.state, record.consecutive_failures) == ("suspect", 1), record
    await controller.report_failure("replica-0", "again")  # a later report is a second probe
    assert (await controller.status()).replicas["replica-0"].state == "dead"
    await controller.shutdown()


async def test_a_replica_restarted_while_the_fleet_resumes_comes_back_serving():
    """replica-1 restarts while the fleet is paused and goes live while ``resume()`` is still
    fanning out (replica-2 slow to answer): the fan-out's list predates it, so it came back
    paused but routable, and every request sent to it waited at its gate."""
    faults = Faults()
    faults.hung_methods = {"resume"}
    controller, replicas = fleet(config(1.5), faults)
    await controller.launch(3)
    await controller.pause()
    faults.hung.add("replica-2")  # resume() waits for it up to control_timeout_s
    faults.dead_actors.append(replicas["replica-1"])
    while controller._records["replica-1"].state.value in ("healthy", "suspect"):
        await asyncio.sleep(0)
    await controller.resume()
    await wait_until(lambda: serving_on(controller, "replica-1", 0), "replica-1 back")
    out = await asyncio.wait_for(replicas["replica-1"].generate("x", [1, 2, 3], {"max_tokens": 4}), 5)
    assert len(out.token_ids) == 4
    await controller.shutdown()


async def test_a_caller_that_gives_up_on_adding_replicas_does_not_leave_them_half_started():
    """Cancelled, the starts stopped half-way: the new replica stayed ``syncing`` for good, its actor
    up, holding its devices, and no probe or restart ever looked at it again."""
    controller, replicas = fleet(config(), Faults())
    await controller.launch(1)
    catch_up = controller._catch_up

    async def slow(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.3)
        return await catch_up(*args, **kwargs)

    controller._catch_up = slow  # type: ignore[method-assign]
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(controller.add_replicas(1), 0.1)
    await wait_until(lambda: serving_on(controller, "replica-1", 0), "replica-1 serving")
    await controller.shutdown()
