"""routing.dispatch_order: longest_group_first: a probe sample of each prompt first, then the held
siblings of the groups whose probe ran longest, each replica preferring the groups it caches."""

from __future__ import annotations

import asyncio
import random

import pytest
from pydantic import ValidationError

from rollfleet.client.dispatch import LongestGroupFirstGate
from rollfleet.config import RolloutConfig, SimEngineConfig
from rollfleet.plan import VirtualFleet
from rollfleet.routing import GlobalRequestLoadBalancer
from rollfleet.utils import virtual_time

pytestmark = pytest.mark.unit


class Slots:
    """A stand-in for the balancer's free slots: each dispatched sample takes one."""

    def __init__(self, **free: int) -> None:
        self.free = dict(free)

    def __call__(self) -> dict[str, int]:
        return dict(self.free)


def sampler(gate: LongestGroupFirstGate, slots: Slots, order: list[str], home: dict[str, str]):
    async def sample(group: str, i: int) -> None:
        rid = f"{group}{i}"
        await gate.wait(request_id=rid, prompt_ids=[ord(group)])
        replica = next(r for r, n in slots.free.items() if n > 0)
        replica = home.get(group, replica) if slots.free.get(home.get(group, ""), 0) > 0 else replica
        slots.free[replica] -= 1
        home[group] = replica
        order.append(rid)
        gate.dispatched(rid, [ord(group)], replica)

    return sample


def test_probes_go_first_in_arrival_order_then_the_siblings_of_the_longest_probes():
    async def main() -> list[str]:
        slots = Slots(r0=0)
        gate = LongestGroupFirstGate(room=slots, limit=10)
        order: list[str] = []
        sample = sampler(gate, slots, order, {})
        tasks = [asyncio.ensure_future(sample(g, i)) for g in "ABC" for i in range(3)]
        await asyncio.sleep(0)
        assert gate.waiting == 9 and order == []  # no room: all held
        slots.free["r0"] = 3
        gate.wake(everyone=True)
        await asyncio.sleep(0)
        assert order == ["A0", "B0", "C0"]  # one probe per prompt, in arrival order
        await asyncio.sleep(1)
        gate.finished("B0")  # B's probe ran 1 s
        await asyncio.sleep(2)
        gate.finished("A0")  # A's ran 3 s
        await asyncio.sleep(1)  # C's still runs, 4 s old: a lower bound already longer than A's
        slots.free["r0"] = 6
        gate.wake(everyone=False)
        await asyncio.gather(*tasks)
        assert gate.waiting == 0
        return order

    order = virtual_time.run(main())
    assert order == ["A0", "B0", "C0", "C1", "C2", "A1", "A2", "B1", "B2"]


def test_a_replica_takes_the_groups_it_caches_first_and_steals_the_longest_when_it_has_none():
    async def main() -> list[str]:
        slots = Slots(r0=1, r1=1)
        gate = LongestGroupFirstGate(room=slots, limit=10)
        order: list[str] = []
        home: dict[str, str] = {}
        sample = sampler(gate, slots, order, home)
        tasks = [asyncio.ensure_future(sample(g, i)) for g in "AB" for i in range(3)]
        await asyncio.sleep(0.001)
        assert order == ["A0", "B0"] and home == {"A": "r0", "B": "r1"}
        await asyncio.sleep(1)
        gate.finished("A0")  # 1 s
        await asyncio.sleep(2)
        gate.finished("B0")  # 3 s: B is the longer group, cached on r1
        slots.free["r0"] = 1
        gate.wake(everyone=False)
        await asyncio.sleep(0)
        assert order[-1] == "A1"  # r0's slot goes to r0's own group, not to the longer B on r1
        slots.free["r0"] = 2
        gate.wake(everyone=False)
        await asyncio.sleep(0)
        assert order[-2:] == ["A2", "B1"]  # A is done waiting: r0 steals B, the longest elsewhere
        assert home["B"] == "r0"
        slots.free["r1"] = 1
        gate.wake(everyone=False)
        await asyncio.gather(*tasks)
        return order

    assert virtual_time.run(main())[-1] == "B2"


def test_a_replica_with_no_group_of_its_own_probes_a_new_prompt_before_it_steals():
    """Past the pool's target no new prompt is probed, except by a replica that would otherwise
    steal: the new prompt's prefill is due anyway, the stolen group's is one more."""

    async def main() -> str:
        slots = Slots(r0=1, r1=1)
        gate = LongestGroupFirstGate(room=slots, limit=1)  # 2 replicas x 1 slot
        order: list[str] = []
        sample = sampler(gate, slots, order, {})
        tasks = [asyncio.ensure_future(sample(g, i)) for g, n in (("A", 5), ("B", 2), ("C", 2)) for i in range(n)]
        await asyncio.sleep(1)
        assert order == ["A0", "B0"]
        gate.finished("A0")  # 1 s
        await asyncio.sleep(1)
        gate.finished("B0")  # 2 s: 1.33 waves x 2 slots, a target of 2.7 held; 5 are
        for _ in range(2):
            slots.free["r1"] = 1
            gate.wake(everyone=False)
            await asyncio.sleep(0)
        nxt = order[-1]
        assert order[-2] == "B1"  # r1's own group first
        slots.free.update(r0=9, r1=9)
        gate.wake(everyone=True)
        await asyncio.gather(*tasks)
        assert gate.waiting == 0
        return nxt

    assert virtual_time.run(main()) == "C0"  # not A1, r0's group


@pytest.mark.parametrize("lookahead, expected", [(10.0, "C0"), (1.0, "B1")])
def test_new_prompts_are_probed_only_while_the_held_siblings_are_too_few_to_rank(lookahead: float, expected: str):
    async def main() -> str:
        slots = Slots(r0=0)
        gate = LongestGroupFirstGate(room=slots, limit=1, lookahead=lookahead)  # 1 replica x 1 slot
        order: list[str] = []
        sample = sampler(gate, slots, order, {})
        tasks = [asyncio.ensure_future(sample(g, i)) for g in "ABC" for i in range(3)]
        await asyncio.sleep(0)
        slots.free["r0"] = 2
        gate.wake(everyone=True)
        await asyncio.sleep(1)
        assert order == ["A0", "B0"]  # no probe has ended: nothing to size the pool by yet
        gate.finished("A0")  # 1 s, the longest and the mean: one wave of the fleet's one slot
        await asyncio.sleep(0.5)  # B's probe still runs, 1.5 s old: the longer group
        slots.free["r0"] = 1
        gate.wake(everyone=False)
        await asyncio.sleep(0)
        nxt = order[-1]
        slots.free["r0"] = 9
        gate.wake(everyone=True)
        await asyncio.gather(*tasks)
        assert gate.waiting == 0
        return nxt

    # 4 siblings held behind A and B: enough to rank at lookahead 1 (1 wave x 1 slot), not at 10
    assert virtual_time.run(main()) == expected


def test_two_wakes_in_one_tick_hand_out_a_slot_once_and_cancelled_waiters_pass_their_turn():
    async def main() -> None:
        slots = Slots(r0=0)
        gate = LongestGroupFirstGate(room=slots, limit=10)
        order: list[str] = []
        sample = sampler(gate, slots, order, {})
        tasks = {f"{g}{i}": asyncio.ensure_future(sample(g, i)) for g in "AB" for i in range(2)}
        await asyncio.sleep(0)
        slots.free["r0"] = 1
        gate.wake(everyone=True)
        gate.wake(everyone=False)  # the slot is granted already: nobody else goes
        tasks["A0"].cancel()  # picked, cancelled before it ran: its slot goes on to the next
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert order == ["A1"], order  # A's next sample, A still unprobed and first in line
        tasks["B1"].cancel()  # cancelled while held
        await asyncio.sleep(0)
        assert gate.waiting == 1  # B0
        slots.free["r0"] = 5
        gate.wake(everyone=False)
        await asyncio.gather(tasks["A1"], tasks["B0"])
        assert order == ["A1", "B0"] and gate.waiting == 0 and tasks["B1"].cancelled()

    virtual_time.run(main())


def test_a_probe_cancelled_before_it_ran_leaves_its_group_unprobed_and_its_sibling_probes_it():
    async def main() -> list[str]:
        slots = Slots(r0=0)
        gate = LongestGroupFirstGate(room=slots, limit=10)
        order: list[str] = []
        sample = sampler(gate, slots, order, {})
        tasks = {f"{g}{i}": asyncio.ensure_future(sample(g, i)) for g in "AB" for i in range(3)}
        await asyncio.sleep(0)
        slots.free["r0"] = 1
        gate.wake(everyone=False)  # A0 is picked as A's probe...
        tasks["A0"].cancel()  # ...and cancelled before its try
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert order == ["A1"]  # A's next sample is its probe, ahead of B's
        slots.free["r0"] = 1
        gate.wake(everyone=False)
        await asyncio.sleep(0)
        assert order == ["A1", "B0"]
        await asyncio.sleep(1)
        gate.finished("B0")  # B's probe ran 1 s
        await asyncio.sleep(2)  # A's still runs, 3 s old: A is the longer group, not a 0 s one
        slots.free["r0"] = 2
        gate.wake(everyone=False)
        await asyncio.sleep(0)
        assert order[2:] == ["A2", "B1"]
        slots.free["r0"] = 1
        gate.wake(everyone=False)
        await asyncio.gather(*(t for name, t in tasks.items() if name != "A0"))
        assert gate.waiting == 0
        return order

    assert virtual_time.run(main()) == ["A1", "B0", "A2", "B1", "B2"]


def test_a_probe_cancelled_in_the_tick_it_is_picked_leaves_its_sibling_to_probe_the_group():
    """Cancelled in the very tick a freed slot picked it, the probe was recorded as its group's
    though it never ran: its sibling went as a non-probe, and the group never got a duration (it
    ranked by an age that only grew, and counted toward no probe)."""

    async def main() -> tuple[list[str], int, bool]:
        gate = LongestGroupFirstGate(room=Slots(r0=0), limit=2)
        first = asyncio.ensure_future(gate.wait(request_id="A0", prompt_ids=[65]))
        second = asyncio.ensure_future(gate.wait(request_id="A1", prompt_ids=[65]))
        for _ in range(3):
            await asyncio.sleep(0)
        first.cancel()  # the caller gives up...
        gate._room = Slots(r0=1)  # ...in the tick a slot frees
        gate.wake(everyone=True)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        probes = list(gate._probes.keys())
        gate.dispatched("A1", [65], "r0")
        await asyncio.sleep(0.5)
        gate.finished("A1")
        return probes, gate._probes_done, second.done()

    probes, done, went = virtual_time.run(main())
    assert probes == ["A1"] and done == 1 and went


def test_a_probe_aborted_mid_way_and_resumed_is_timed_to_its_end_not_to_the_abort():
    async def main() -> list[str]:
        slots = Slots(r0=2)
        gate = LongestGroupFirstGate(room=slots, limit=10)
        order: list[str] = []
        sample = sampler(gate, slots, order, {})
        tasks = [asyncio.ensure_future(sample(g, i)) for g in "AB" for i in range(2)]
        await asyncio.sleep(0.001)
        assert order == ["A0", "B0"]
        await asyncio.sleep(1)
        gate.finished("A0", ended=False)  # a weight sync aborted A's probe at 1 s; it resumes
        gate.finished("B0", ended=False)  # and B's
        await asyncio.sleep(1)
        gate.finished("B0")  # B's ended at 2 s
        await asyncio.sleep(2)
        gate.finished("A0")  # A's at 4 s: A is the longer group
        slots.free["r0"] = 1
        gate.wake(everyone=False)
        await asyncio.sleep(0)
        slots.free["r0"] = 1
        gate.wake(everyone=False)
        await asyncio.gather(*tasks)
        return order

    assert virtual_time.run(main()) == ["A0", "B0", "A1", "B1"]


def test_the_balancer_holds_placed_siblings_when_the_order_decides_but_never_a_session_turn():
    lb = GlobalRequestLoadBalancer(
        {"s0": "h0", "s1": "h1"}, policy="prefix_affinity", seed=0, max_inflight_per_replica=1
    )
    lb.hold_placed = True
    assert lb.free_slots() == {"s0": 1, "s1": 1}
    first, _ = lb.try_acquire_server("g-0", 3, [7, 7, 7])
    lb.try_acquire_server("session", 3, [1, 2, 3])
    assert lb.free_slots() == {"s0": 0, "s1": 0}
    assert lb.try_acquire_server("g-1", 3, [7, 7, 7]) is None  # a sibling waits for room too
    assert lb.try_acquire_server("session", 3, [1, 2, 3, 4]) is not None  # a session's next turn never
    lb.release_server(first, 3)
    assert lb.try_acquire_server("g-1", 3, [7, 7, 7])[0] == first  # back home once it has room


def test_an_ordered_dispatch_without_late_binding_is_refused_naming_both_fields():
    with pytest.raises(ValidationError, match="routing.dispatch_order.*max_inflight_per_replica"):
        RolloutConfig(name="sim", routing={"dispatch_order": "longest_group_first"})


def grpo_config(order: str) -> RolloutConfig:
    return RolloutConfig(
        name="sim",
        num_replicas=2,
        prompt_length=256,
        response_length=256,
        max_model_len=1024,
        routing={"policy": "prefix_affinity", "seed": 0, "max_inflight_per_replica": 10, "dispatch_order": order},
        sim=SimEngineConfig(
            vocab_size=1000,
            max_num_seqs=8,
            mean_response_tokens=60,
            response_sigma=0.8,
            cache_on_prefill=True,
            max_steps_per_wake=1_000_000,
        ),
    )


def rollout(order: str) -> tuple[float, float, int, int]:
    """32 groups x 8 samples on 2 replicas x 8 slots: (makespan, mean length of the samples that
    ended in the last tenth of it, requests left in flight, requests left held)."""

    async def main() -> tuple[float, float, int, int]:
        fleet = await VirtualFleet(grpo_config(order)).start()
        client = fleet.client
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 1000) for _ in range(64)] for _ in range(32)]
        ends: list[tuple[float, int]] = []
        start = virtual_time.now()

        async def sample(g: int, i: int) -> None:
            out = await client.generate(
                f"g{g}-{i}", prompt_ids=prompts[g], sampling_params={"max_tokens": 256, "seed": g * 100 + i}
            )
            ends.append((virtual_time.now() - start, len(out.token_ids)))

        try:
            await asyncio.gather(*(sample(g, i) for g in range(32) for i in range(8)))
            makespan = virtual_time.now() - start
            tail = [n for t, n in ends if t > 0.9 * makespan]
            gate = client._gate
            assert gate is not None
            return makespan, sum(tail) / len(tail), client.balancer.get_total_inflight(), gate.waiting
        finally:
            await fleet.shutdown()

    return virtual_time.run(main())


@pytest.mark.timeout(120)
def test_on_a_virtual_fleet_the_ordered_rollout_ends_sooner_and_leaks_nothing():
    fifo = rollout("fifo")
    ordered = rollout("longest_group_first")
    assert fifo[2:] == (0, 0) and ordered[2:] == (0, 0)  # every sample finished, no count left over
    assert ordered[0] < fifo[0], (ordered, fifo)
    assert ordered[1] < fifo[1], (ordered, fifo)  # what runs last is shorter


def test_a_resuming_client_tells_the_gate_an_aborted_attempt_did_not_end_its_sample():
    async def main() -> list[tuple[str, bool]]:
        fleet = await VirtualFleet(grpo_config("longest_group_first")).start()
        client = fleet.client
        gate = client._gate
        assert gate is not None
        calls: list[tuple[str, bool]] = []
        heard = gate.finished
        gate.finished = lambda rid, ended=True: (calls.append((rid, ended)), heard(rid, ended))[1]  # type: ignore[method-assign]
        rng = random.Random(1)
        prompts = [[rng.randrange(3, 1000) for _ in range(64)] for _ in range(8)]
        try:
            samples = asyncio.gather(
                *(
                    client.generate(f"g{g}-{i}", prompt_ids=prompts[g], sampling_params={"max_tokens": 256, "seed": i})
                    for g in range(8)
                    for i in range(4)
                )
            )
            await asyncio.sleep(0.5)
            await fleet.update_weights(mode="abort")  # aborts what runs; the client resumes it
            outs = await samples
            assert all(out.stop_reason != "aborted" for out in outs)
            return calls
        finally:
            await fleet.shutdown()

    calls = virtual_time.run(main())
    aborted = {rid for rid, ended in calls if not ended}
    ends = [rid for rid, ended in calls if ended]
    assert aborted, "the weight update aborted nothing: the test proves nothing"
    assert sorted(ends) == sorted({rid for rid, _ in calls})  # each sample ended once, aborted or not
    assert all(calls.index((rid, False)) < calls.index((rid, True)) for rid in aborted)
