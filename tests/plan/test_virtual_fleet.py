"""Virtual time (rollfleet.utils.virtual_time) and the in-process fleet on it (rollfleet.plan):
simulated seconds cost no wall time, and a run repeats exactly whatever the host is doing."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from rollfleet.config import RolloutConfig, SimEngineConfig
from rollfleet.engines.sim import StepCost
from rollfleet.plan import FleetReport, VirtualFleet
from rollfleet.utils import virtual_time

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def test_the_clock_jumps_to_each_timer_and_timeouts_fire_in_virtual_time():
    async def main() -> tuple[list[float], float]:
        loop = asyncio.get_running_loop()

        async def ticker(period: float) -> float:
            for _ in range(1000):
                await asyncio.sleep(period)
            return loop.time()

        ends = await asyncio.gather(ticker(0.25), ticker(1.0))
        with pytest.raises(asyncio.TimeoutError):  # an hour-long wait, cut at half an hour: no wall time
            await asyncio.wait_for(asyncio.sleep(3600), 1800)
        return ends, loop.time()

    ends, now = virtual_time.run(main())
    assert ends == pytest.approx([250.0, 1000.0])
    assert now == pytest.approx(2800.0)


def test_a_threads_result_wakes_the_loop_and_waiting_on_nothing_is_an_error():
    async def with_thread() -> str:
        return await asyncio.to_thread(lambda: "done")

    assert virtual_time.run(with_thread()) == "done"

    async def forever() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(virtual_time.Stalled, match="no timer is scheduled"):
        virtual_time.run(forever(), idle_timeout_s=0.2)

    async def slow_thread() -> None:  # not "nothing to run": a thread outlived the wait
        await asyncio.to_thread(time.sleep, 0.6)

    with pytest.raises(virtual_time.Stalled, match="1 executor call\\(s\\) still running after 0.2 s"):
        virtual_time.run(slow_thread(), idle_timeout_s=0.2)


def test_a_thread_takes_no_virtual_time_and_a_timeout_around_it_does_not_fire():
    """While a thread works, the clock used to jump to the next timer: a ``wait_for`` around a
    0.2 s thread timed out at once, and a 1 s ticker ran the clock 25,000 s ahead meanwhile."""

    async def main() -> tuple[str, float, int]:
        loop = asyncio.get_running_loop()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(1.0)
                ticks += 1

        task = asyncio.create_task(ticker())
        start = loop.time()
        result = await asyncio.wait_for(loop.run_in_executor(None, lambda: time.sleep(0.2) or "done"), timeout=10)
        await asyncio.to_thread(time.sleep, 0.1)
        task.cancel()
        return result, loop.time() - start, ticks

    result, elapsed, ticks = virtual_time.run(main(), idle_timeout_s=5)
    assert result == "done" and elapsed == 0.0 and ticks == 0

    async def hung() -> float:
        loop = asyncio.get_running_loop()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(loop.run_in_executor(None, time.sleep, 1.0), timeout=3)
        return loop.time()

    assert virtual_time.run(hung(), idle_timeout_s=0.3) == pytest.approx(3.0)  # past the real wait: time goes on

    async def left_running() -> float:
        loop = asyncio.get_running_loop()
        release = threading.Event()
        thread = loop.run_in_executor(None, release.wait, 30.0)  # a call nobody waits for any more
        start = time.monotonic()
        for _ in range(20):
            await asyncio.sleep(1.0)
        elapsed = time.monotonic() - start
        release.set()
        await thread
        return elapsed

    # waited for once (0.3 s), not before each of the 20 jumps (6 s)
    assert virtual_time.run(left_running(), idle_timeout_s=0.3) < 2.0


def test_real_io_is_delivered_while_the_loop_stays_busy():
    """The selector polls real descriptors only every BUSY_POLL_EVERY-th busy iteration: data on a
    socket still arrives while other tasks keep the ready queue full (never polling would hang)."""

    async def main() -> tuple[bytes, int]:
        reader, writer = await asyncio.open_unix_connection(sock=left)
        spins = 0
        done = asyncio.Event()

        async def spin() -> None:
            nonlocal spins
            while not done.is_set():
                spins += 1
                await asyncio.sleep(0)  # ready again at once: the loop never waits for a timer

        spinner = asyncio.create_task(spin())
        threading.Timer(0.05, right.sendall, args=(b"ping",)).start()
        data = await reader.readexactly(4)
        done.set()
        await spinner
        writer.close()
        return data, spins

    left, right = socket.socketpair()
    try:
        data, spins = virtual_time.run(main(), idle_timeout_s=5)
    finally:
        right.close()
    assert data == b"ping" and spins > virtual_time.BUSY_POLL_EVERY


def rollout(**sim) -> RolloutConfig:
    return RolloutConfig(
        name="sim",
        num_replicas=2,
        prompt_length=1024,
        response_length=512,
        max_model_len=4096,
        routing={"seed": 3},
        sim=SimEngineConfig(vocab_size=1000, max_num_seqs=8, mean_response_tokens=60, cache_on_prefill=True, **sim),
    )


@pytest.mark.parametrize("context_ms, time_scale", [(0.0, 1.0), (0.002, 1.0), (0.0, 10.0)])
def test_a_lone_request_takes_exactly_its_modelled_time(context_ms, time_scale):
    """Prefill on the first step, then one token per step of ``step_base + step_per_seq`` ms plus,
    with a context cost, ``step_per_context_token_ms`` per token the sequence holds at that step.
    A config's ``time_scale`` (wall-clock pacing) does not shrink a virtual fleet's seconds: its
    makespan and its engines' busy time are the same simulated seconds."""
    config = rollout(step_per_context_token_ms=context_ms, time_scale=time_scale)
    prompt, budget = list(range(3, 3 + 200)), 300

    async def main() -> tuple[FleetReport, int]:
        fleet = await VirtualFleet(config).start()
        out = await fleet.client.generate(
            "one", prompt_ids=prompt, sampling_params={"max_tokens": budget, "ignore_eos": True}
        )
        report = await fleet.report()
        await fleet.shutdown()
        return report, len(out.token_ids)

    report, tokens = virtual_time.run(main())
    sim = config.sim
    assert tokens == budget
    held = sum(len(prompt) + k for k in range(budget))  # context at each step: the prompt, then k tokens
    expected_ms = (
        budget * (sim.step_base_ms + sim.step_per_seq_ms) + len(prompt) * sim.prefill_per_token_ms + context_ms * held
    )
    assert StepCost.of(sim).decode_ms(len(prompt), budget) + StepCost.of(sim).prefill_ms(len(prompt)) == (
        pytest.approx(expected_ms)
    )  # the bound's arithmetic (benchmarks/routing_quality.py) is the engine's
    assert report.makespan_s == pytest.approx(expected_ms / 1000.0, abs=1e-6)
    assert sum(report.busy_s.values()) == pytest.approx(expected_ms / 1000.0, abs=1e-6)


async def grpo_with_an_update(config: RolloutConfig) -> tuple[FleetReport, list[tuple[int, ...]]]:
    fleet = await VirtualFleet(config).start()
    prompts = [[5 + (g * 31 + k) % 900 for k in range(128)] for g in range(6)]

    async def sample(g: int, i: int):
        return await fleet.client.generate(
            f"g{g}-{i}", prompt_ids=prompts[g], sampling_params={"max_tokens": 200, "seed": g * 10 + i}
        )

    tasks = [asyncio.ensure_future(sample(g, i)) for g in range(6) for i in range(4)]
    await asyncio.sleep(0.5)  # simulated: the update lands mid-rollout
    await fleet.update_weights(mode="keep")
    outs = await asyncio.gather(*tasks)
    report = await fleet.report()
    await fleet.shutdown()
    return report, [tuple(o.token_ids) for o in outs]


def test_a_run_repeats_exactly_even_while_the_host_is_busy():
    config = rollout()
    first = virtual_time.run(grpo_with_an_update(config))
    stop = threading.Event()

    def hog() -> None:  # competes for the GIL and the cores: wall time changes, results must not
        while not stop.is_set():
            sum(i * i for i in range(10_000))

    threads = [threading.Thread(target=hog, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        second = virtual_time.run(grpo_with_an_update(config))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert first == second
    report = first[0]
    assert report.output_tokens == sum(len(t) for t in first[1]) and report.makespan_s > 0.5
    assert report.prompt_tokens >= 24 * 128 and 0 < report.prefix_hit_rate < 1


def test_keep_mode_updates_leave_every_generation_whole_and_labelled():
    async def main():
        fleet = await VirtualFleet(rollout()).start()
        tasks = [
            asyncio.ensure_future(
                fleet.client.generate(
                    f"r{i}", prompt_ids=[7, 8, 9 + i], sampling_params={"max_tokens": 400, "ignore_eos": True}
                )
            )
            for i in range(8)
        ]
        for _ in range(3):
            await asyncio.sleep(0.4)
            await fleet.update_weights(mode="keep")
        outs = await asyncio.gather(*tasks)
        await fleet.shutdown()
        return outs

    outs = virtual_time.run(main())
    assert all(len(o.token_ids) == 400 for o in outs)
    assert all(o.extra_fields["num_resumes"] == 0 for o in outs)  # keep: never resubmitted
    assert {o.extra_fields["max_global_steps"] for o in outs} == {3}
    assert {o.extra_fields["min_global_steps"] for o in outs} == {0}


def test_an_update_reports_how_long_it_paused_the_fleet_as_the_managers_does():
    """``pause_s`` (what ``rollfleet simulate`` reports as the update's pause) is the commit
    window, the weight load; the staging before it went on while the fleet served."""

    async def main() -> dict:
        fleet = await VirtualFleet(rollout(weight_load_ms=50.0)).start()
        result = await fleet.update_weights(mode="keep")
        await fleet.shutdown()
        return result

    result = virtual_time.run(main())
    ((start, end),) = result["paused"]
    assert result["pause_s"] == pytest.approx(end - start) == pytest.approx(0.05)
    assert result["total_s"] >= result["pause_s"]


def test_a_thread_given_up_on_that_ends_later_does_not_uncount_one_started_since():
    """A's thread outlived idle_timeout_s and was given up on; when it ended, it took B's count
    away, and the clock jumped past B's 5 s timeout while B (0.4 s of real work) still ran."""

    async def main() -> tuple[str, float]:
        loop = asyncio.get_running_loop()
        a = loop.run_in_executor(None, time.sleep, 0.6)  # given up on after 0.3 s, ends 0.3 s later
        await asyncio.sleep(1.0)
        b = await asyncio.wait_for(loop.run_in_executor(None, lambda: time.sleep(0.4) or "B done"), 5)
        await a
        return b, loop.time()

    result, clock = virtual_time.run(main(), idle_timeout_s=0.3)
    assert result == "B done" and clock == pytest.approx(1.0)


def test_a_rolling_update_commits_in_waves_of_max_unavailable_while_the_rest_generate():
    """A plan of ``rolling`` committed every replica at once, as ``keep``: varying the mode gave
    the same plan twice. Now waves of ``max_unavailable`` of the fleet commit one after another,
    and a replica outside the wave goes on generating through it."""

    async def main(mode: str) -> tuple[dict, list]:
        config = rollout(weight_load_ms=50.0).model_copy(update={"num_replicas": 4})
        config.weight_sync.max_unavailable = 0.5
        fleet = await VirtualFleet(config).start()
        params = {"max_tokens": 300, "ignore_eos": True}
        tasks = [asyncio.ensure_future(fleet.client.generate(f"r{i}", prompt_ids=[7, 8, 9 + i], sampling_params=params))
                 for i in range(8)]  # fmt: skip
        await asyncio.sleep(0.2)
        result = await fleet.update_weights(mode=mode)
        outs = await asyncio.gather(*tasks)
        await fleet.shutdown()
        return result, outs

    rolling, outs = virtual_time.run(main("rolling"))
    keep, _ = virtual_time.run(main("keep"))
    assert rolling["mode"] == "rolling" and rolling["waves"] == 2 and keep["waves"] == 1
    (first, second) = rolling["paused"]
    assert first[1] <= second[0] and rolling["pause_s"] == pytest.approx(0.05)  # one after the other
    assert rolling["total_s"] == pytest.approx(keep["total_s"] + 0.05)
    assert all(len(o.token_ids) == 300 and o.extra_fields["num_resumes"] == 0 for o in outs)

    async def typo() -> None:
        fleet = await VirtualFleet(rollout()).start()
        try:
            await fleet.update_weights(mode="rollling")
        finally:
            await fleet.shutdown()

    with pytest.raises(ValueError, match="weight_sync.mode must be abort, keep or rolling"):
        virtual_time.run(typo())
