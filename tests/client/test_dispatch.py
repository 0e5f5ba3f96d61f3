"""Late binding (routing.max_inflight_per_replica): requests wait in the client until a replica has
room; sessions and placed siblings are never held; waiting and cancelling leak nothing."""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence

import pytest

from rollfleet.client import LLMServerClient
from rollfleet.client.dispatch import DispatchGate
from rollfleet.config import RolloutConfig, SimEngineConfig
from rollfleet.errors import RetriesExhausted
from rollfleet.plan import VirtualFleet
from rollfleet.routing import GlobalRequestLoadBalancer
from rollfleet.server.local import LocalHandle
from rollfleet.types import LoadReport, ReplicaResponse, TokenOutput
from rollfleet.utils import virtual_time

pytestmark = pytest.mark.unit


def limited(n: int = 2, limit: int = 2, policy: str = "least_tokens") -> GlobalRequestLoadBalancer:
    return GlobalRequestLoadBalancer(
        {f"s{i}": f"h{i}" for i in range(n)}, policy=policy, seed=0, max_inflight_per_replica=limit
    )


def test_a_new_placement_is_held_while_every_replica_is_at_the_limit():
    lb = limited(2, 2)
    got = [lb.try_acquire_server(f"r{i}", 4, [i, 1, 2]) for i in range(4)]
    assert all(g is not None for g in got)
    assert lb.get_status()["servers"] == {"s0": 2, "s1": 2}
    assert lb.try_acquire_server("r4", 4, [4, 1, 2]) is None  # held: nothing was counted
    assert lb.get_total_inflight() == 4
    assert lb.acquire_server("r5", 4, [5, 1, 2]) is not None  # verl's call never holds
    lb.release_server("s0", 4)
    lb.release_server("s0", 4)
    assert lb.try_acquire_server("r4", 4, [4, 1, 2])[0] == "s0"  # the replica that freed up


def test_session_turns_and_placed_siblings_are_never_held():
    lb = limited(2, 1, policy="prefix_affinity")
    first, _ = lb.try_acquire_server("session", 3, [1, 2, 3])
    sibling, _ = lb.try_acquire_server("g-0", 3, [7, 7, 7])
    assert lb.try_acquire_server("other", 3, [9, 9, 9]) is None  # both replicas at the limit
    assert lb.try_acquire_server("session", 3, [1, 2, 3, 4])[0] == first  # its next turn goes on
    assert lb.try_acquire_server("g-1", 3, [7, 7, 7])[0] == sibling  # so does a sibling of a placed prompt


def test_a_release_wakes_one_waiter_and_a_report_of_others_finishing_wakes_all():
    lb = limited(2, 1)
    calls: list[bool] = []
    lb.on_room = calls.append
    sid, _ = lb.acquire_server("a", 1)
    lb.release_server(sid, 1)
    assert calls == [False]
    lb.report_load(LoadReport(replica_id="s1", inflight=3, inflight_tokens=3, timestamp=1.0))
    assert calls == [False]  # others' load went up: nothing to wake
    lb.report_load(LoadReport(replica_id="s1", inflight=1, inflight_tokens=1, timestamp=2.0))
    assert calls == [False, True]


async def test_the_gate_is_fifo_a_rewoken_waiter_keeps_its_place_and_a_cancelled_one_passes_its_turn():
    gate = DispatchGate()
    order: list[str] = []

    async def waiter(name: str, front: bool = False) -> None:
        await gate.wait(front=front)
        order.append(name)

    a = asyncio.ensure_future(waiter("a"))
    b = asyncio.ensure_future(waiter("b"))
    c = asyncio.ensure_future(waiter("c"))
    await asyncio.sleep(0)
    retry = asyncio.ensure_future(waiter("retry", front=True))
    await asyncio.sleep(0)
    assert gate.waiting == 4
    gate.wake(everyone=False)
    await asyncio.sleep(0)
    assert order == ["retry"]
    gate.wake(everyone=False)  # picks a, which is cancelled before it runs: b gets the turn
    a.cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert order == ["retry", "b"] and a.cancelled()
    c.cancel()
    await asyncio.sleep(0)
    assert gate.waiting == 0 and b.done() and retry.done()


async def test_waiters_woken_together_that_find_no_room_keep_their_order():
    """Every load refresh wakes every waiter; each that found no room went back to the very
    front, one after the other: the line came out reversed (r4 first) at every refresh."""
    gate = DispatchGate()
    order: list[str] = []
    room = [0]

    async def request(name: str) -> None:
        woken = False
        while True:
            if woken and room[0] > 0:
                room[0] -= 1
                order.append(name)
                gate.dispatched(name, [], "s0")
                return
            await gate.wait(front=woken, request_id=name)
            woken = True

    tasks = [asyncio.ensure_future(request(f"r{i}")) for i in range(5)]
    await asyncio.sleep(0)
    for _ in range(3):  # refreshes with no room: everyone tries, everyone goes back
        gate.wake(everyone=True)
        for _ in range(3):
            await asyncio.sleep(0)
    assert gate.waiting == 5 and order == []
    room[0] = 5
    gate.wake(everyone=False)
    await asyncio.gather(*tasks)
    assert order == ["r0", "r1", "r2", "r3", "r4"]


def test_a_sibling_of_a_placed_prompt_is_not_held_behind_the_line():
    """FIFO passes a sibling whose prompt has a home (its cache is there): the balancer would take
    it at once, yet the client queued it behind every held request until one of its own ended."""
    config = RolloutConfig(
        name="sim", num_replicas=2, prompt_length=64, response_length=32, max_model_len=256,
        routing={"policy": "prefix_affinity", "max_inflight_per_replica": 1, "seed": 0},
        sim=SimEngineConfig(vocab_size=500, step_base_ms=10.0, mean_response_tokens=20),
    )  # fmt: skip

    async def main() -> list[str]:
        fleet = await VirtualFleet(config).start()
        params = {"max_tokens": 20, "ignore_eos": True}
        client = fleet.client
        first = asyncio.ensure_future(client.generate("g-0", prompt_ids=[7] * 8, sampling_params=params))
        other = asyncio.ensure_future(client.generate("o-0", prompt_ids=[9] * 8, sampling_params=params))
        await asyncio.sleep(0.001)
        held = asyncio.ensure_future(client.generate("h-0", prompt_ids=[5] * 8, sampling_params=params))
        await asyncio.sleep(0.001)
        assert client._gate is not None and client._gate.waiting == 1  # both replicas at the limit
        sibling = asyncio.ensure_future(client.generate("g-1", prompt_ids=[7] * 8, sampling_params=params))
        await asyncio.sleep(0.001)
        went = [r for r, t in (("g-1", sibling), ("h-0", held)) if client.balancer.is_placed(r)]
        await asyncio.gather(first, other, held, sibling)
        await fleet.shutdown()
        return went

    assert virtual_time.run(main()) == ["g-1"]  # placed at once; the held request still waits


class _LoggedReplica:
    """Answers one token after ``seconds(request_id)`` of virtual time; logs ``(request_id, when)``
    as each request reaches it, in a log its fleet shares."""

    def __init__(self, name: str, log: list[tuple[str, float]], seconds: Callable[[str], float]) -> None:
        self.name, self.log, self.seconds = name, log, seconds

    async def generate_with_load(self, request_id, prompt_ids, params, **kwargs):
        self.log.append((request_id, virtual_time.now()))
        await asyncio.sleep(self.seconds(request_id))
        out = TokenOutput(token_ids=[7], log_probs=[-0.1], stop_reason="length", extra_fields={"global_steps": 0})
        return ReplicaResponse(out, LoadReport(replica_id=self.name, timestamp=virtual_time.now()))


def _one_slot_each(names: Sequence[str], log: list, seconds: Callable[[str], float]) -> LLMServerClient:
    """A late-binding client over :class:`_LoggedReplica` replicas of one slot each, in arrival order."""
    config = RolloutConfig(
        response_length=1, retry={"jitter": 0.0}, routing={"policy": "least_inflight", "max_inflight_per_replica": 1}
    )
    return LLMServerClient(config, servers={n: LocalHandle(_LoggedReplica(n, log, seconds)) for n in names})


def test_a_request_arriving_as_a_slot_frees_queues_behind_the_held_ones():
    """One replica, one slot. W1 and W2 are held; N arrives in the loop step after X ends, while W1
    is woken but has not run yet: N took the slot before W1 and W2."""

    async def main(spins: int) -> list[str]:
        log: list[tuple[str, float]] = []
        client = _one_slot_each(["A"], log, lambda request_id: 1.0)
        params = {"max_tokens": 1}
        tasks = [asyncio.ensure_future(client.generate("X", prompt_ids=[1], sampling_params=params))]
        for name, prompt in (("W1", [2]), ("W2", [3])):
            await asyncio.sleep(0.1)
            tasks.append(asyncio.ensure_future(client.generate(name, prompt_ids=prompt, sampling_params=params)))
        await asyncio.sleep(0.8)  # X ends now
        for _ in range(spins):
            await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(client.generate("N", prompt_ids=[4], sampling_params=params)))
        await asyncio.gather(*tasks)
        assert client.balancer.get_total_inflight() == 0
        return [request_id for request_id, _ in log]

    for spins in range(6):
        assert virtual_time.run(main(spins)) == ["X", "W1", "W2", "N"], spins


def test_two_slots_freed_in_one_tick_serve_the_held_request_and_one_arriving_meanwhile():
    """X and Y end at t=1 on two replicas; W1 (held) is woken for one slot, the second wake finds
    nobody; N arrives before W1 runs and queues behind it. N waited for W1's 10 s on A while B
    stood idle: a woken request that gets its replica now lets the next one try."""

    async def main(spins: int) -> dict[str, float]:
        log: list[tuple[str, float]] = []
        client = _one_slot_each(["A", "B"], log, lambda request_id: 10.0 if request_id == "W1" else 1.0)
        params = {"max_tokens": 1}
        tasks = [
            asyncio.ensure_future(client.generate(n, prompt_ids=[k], sampling_params=params))
            for k, n in ((1, "X"), (2, "Y"))
        ]
        await asyncio.sleep(0.1)
        tasks.append(asyncio.ensure_future(client.generate("W1", prompt_ids=[5], sampling_params=params)))
        await asyncio.sleep(0.9)  # X and Y end now
        for _ in range(spins):
            await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(client.generate("N", prompt_ids=[6], sampling_params=params)))
        await asyncio.gather(*tasks)
        assert client.balancer.get_total_inflight() == 0
        return dict(log)

    for spins in range(4):
        started = virtual_time.run(main(spins))
        assert started["W1"] == started["N"] == pytest.approx(1.0), (spins, started)


def fleet_config(limit: int) -> RolloutConfig:
    return RolloutConfig(
        name="sim",
        num_replicas=2,
        prompt_length=512,
        response_length=128,
        max_model_len=1024,
        routing={"policy": "prefix_affinity", "seed": 0, "max_inflight_per_replica": limit},
        sim=SimEngineConfig(vocab_size=500, max_num_seqs=4, mean_response_tokens=30, cache_on_prefill=True),
    )


@pytest.mark.timeout(120)
def test_on_a_virtual_fleet_held_requests_all_finish_and_cancelled_ones_leak_nothing():
    async def main() -> tuple[int, int, int, int]:
        fleet = await VirtualFleet(fleet_config(limit=3)).start()
        client = fleet.client
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, *client.balancer.get_status()["servers"].values())
                await asyncio.sleep(0.001)

        watcher = asyncio.ensure_future(watch())
        try:
            tasks = [
                asyncio.ensure_future(
                    client.generate(f"r{i}", prompt_ids=[5 + i, 6, 7, 8], sampling_params={"max_tokens": 40})
                )
                for i in range(30)
            ]
            await asyncio.sleep(0.01)  # simulated: six are running, the rest wait in the client
            held = client._gate.waiting if client._gate is not None else -1
            for t in tasks[-5:]:
                t.cancel()
            outs = await asyncio.gather(*tasks[:-5])
            assert all(len(o.token_ids) > 0 for o in outs)
            return held, peak, client.balancer.get_total_inflight(), client._gate.waiting
        finally:
            watcher.cancel()
            await fleet.shutdown()

    held, peak, inflight, waiting = virtual_time.run(main())
    assert held == 24  # 30 requests, 2 replicas x 3 in flight
    assert peak == 3  # never more than the limit on a replica (distinct prompts: no sibling passes)
    assert inflight == 0 and waiting == 0  # the 25 done, the 5 cancelled while waiting: nothing leaked


def test_requests_held_when_the_last_replica_leaves_end_in_the_retry_policy_not_in_the_line():
    """One replica, one slot: X runs, W1 is held, N1 and N2 arrive in the tick the replica is
    removed. The removal woke W1, N1 and N2 queued behind it, W1's try failed (no replica) and it
    went back into the line, which only a release wakes: after X they all waited for good, never
    reaching ``retry.no_server_wait_s``."""

    async def main() -> None:
        client = _one_slot_each(["A"], [], lambda request_id: 1.0)
        params = {"max_tokens": 1}

        def send(name: str, prompt: list[int]) -> asyncio.Future:
            return asyncio.ensure_future(client.generate(name, prompt_ids=prompt, sampling_params=params))

        x = send("X", [1])
        await asyncio.sleep(0.1)
        w1 = send("W1", [2])
        await asyncio.sleep(0.1)
        assert client._gate.waiting == 1
        held = [w1, send("N1", [3]), send("N2", [4])]
        client.balancer.remove_servers(["A"])
        await x
        done, pending = await asyncio.wait(held, timeout=2 * client.config.retry.no_server_wait_s)
        assert not pending, f"{len(pending)} requests still held, {client._gate.waiting} in the gate"
        assert all(isinstance(t.exception(), RetriesExhausted) for t in done)
        assert client._gate.waiting == 0 and client.balancer.get_total_inflight() == 0

    virtual_time.run(main())


def test_a_held_request_goes_where_a_wider_preferred_set_has_room():
    """Only A preferred (a rolling update's first wave), A full: W is held. The update ends and
    every replica may take new work: W used to wait for A's request to end (1 s), with B free."""

    async def main() -> list[tuple[str, float]]:
        log: list[tuple[str, float]] = []
        client = _one_slot_each(["A", "B"], log, lambda request_id: 1.0)
        client.balancer.set_preferred(["A"])
        params = {"max_tokens": 1}
        x = asyncio.ensure_future(client.generate("X", prompt_ids=[1], sampling_params=params))
        await asyncio.sleep(0.1)
        w = asyncio.ensure_future(client.generate("W", prompt_ids=[2], sampling_params=params))
        await asyncio.sleep(0.1)
        assert client._gate.waiting == 1
        client.balancer.set_preferred(None)
        await asyncio.gather(x, w)
        return log

    log = virtual_time.run(main())
    assert [request_id for request_id, _ in log] == ["X", "W"]
    assert log[1][1] == pytest.approx(0.2)  # at once, on B
