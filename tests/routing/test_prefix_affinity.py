"""prefix_affinity: requests with one prompt (a GRPO group) share a replica, within a load bound."""

from __future__ import annotations

import asyncio
from typing import Sequence

import pytest

from rollfleet.config import RolloutConfig, SimEngineConfig
from rollfleet.plan import VirtualFleet
from rollfleet.routing import GlobalRequestLoadBalancer, get_policy
from rollfleet.routing.policies import ReplicaView, RoutingPolicy
from rollfleet.routing.policies.prefix_affinity import PrefixAffinityPolicy
from rollfleet.types import LoadReport
from rollfleet.utils import virtual_time

pytestmark = pytest.mark.unit


def balancer(n: int = 4, **policy_kw) -> GlobalRequestLoadBalancer:
    policy = get_policy("prefix_affinity", seed=0, **policy_kw)
    return GlobalRequestLoadBalancer({f"s{i}": f"h{i}" for i in range(n)}, policy=policy)


def test_siblings_of_one_prompt_share_a_replica_and_groups_spread():
    lb = balancer(4)
    homes = {}
    for g in range(8):
        prompt = [100 + g, 7, 7, 7]
        chosen = {lb.acquire_server(f"g{g}-s{i}", len(prompt), prompt)[0] for i in range(8)}
        assert len(chosen) == 1, (g, chosen)  # every sibling where the first one went
        homes[g] = chosen.pop()
    # homes are chosen by load: 8 groups of 8 on 4 replicas, two groups each
    assert sorted(lb.get_status()["servers"].values()) == [16, 16, 16, 16]
    assert len(set(homes.values())) == 4


def test_a_home_past_the_load_bound_gives_way_to_the_least_loaded_replica():
    lb = balancer(2, load_factor=1.0, slack=1)
    prompt = [5, 6, 7]
    first = [lb.acquire_server(f"s{i}", 3, prompt)[0] for i in range(3)]
    # bound = mean (counting the new request) + 1: the third sibling would make 3 on its home
    # against a bound of 1.5 + 1
    assert first[0] == first[1] and first[2] != first[0]
    # the replica it spilled to is the prompt's new home
    assert lb.acquire_server("s3", 3, prompt)[0] == first[2]


def test_a_home_past_the_bound_is_left_even_when_its_tokens_are_the_fewest():
    """The bound counts requests; the fallback ranks by tokens. A home full of short siblings is
    still the replica with the fewest tokens, and used to be picked again, past its bound."""
    lb = balancer(2)
    prompt = [3] * 4
    home, _ = lb.acquire_server("g0", 1, prompt)
    other = "s1" if home == "s0" else "s0"
    lb.report_load(LoadReport(replica_id=other, inflight=1, inflight_tokens=100_000, timestamp=1.0))
    for i in range(1, 200):
        lb.acquire_server(f"g{i}", 1, prompt)
    policy = lb.policy
    assert isinstance(policy, PrefixAffinityPolicy)
    loads = lb.get_status()["estimated_load"]
    bound = policy.load_factor * sum(loads.values()) / 2 + policy.slack
    assert max(loads.values()) <= bound, loads


def test_a_sibling_whose_home_cannot_take_it_waits_for_room_as_a_new_placement_does():
    """Under a dispatch limit a sibling skips the wait only when it goes to its home: with the
    home quarantined, or past the bound, it starts a new placement and waits like one."""
    policy = get_policy("prefix_affinity", seed=0)
    lb = GlobalRequestLoadBalancer({"s0": "h0", "s1": "h1"}, policy=policy, max_inflight_per_replica=2, sticky=False)
    prompt = [7] * 50
    home, _ = lb.try_acquire_server("g0", 50, prompt)
    other = "s1" if home == "s0" else "s0"
    lb.report_load(LoadReport(replica_id=other, inflight=2, inflight_tokens=100, timestamp=1.0))
    assert lb.try_acquire_server("g1", 50, prompt)[0] == home  # its home has room under the bound
    lb.set_routable(home, False)
    assert lb.try_acquire_server("g2", 50, prompt) is None  # not sent past the limit elsewhere
    lb.report_load(LoadReport(replica_id=other, inflight=1, inflight_tokens=50, timestamp=2.0))
    assert lb.try_acquire_server("g3", 50, prompt)[0] == other  # room: it goes, and finds a new home


def test_a_replica_that_leaves_takes_its_homes_with_it():
    lb = balancer(3)
    prompt = [9, 9, 9]
    home, _ = lb.acquire_server("a", 3, prompt)
    lb.remove_servers([home])
    assert lb.get_status()["registered_handles"] == 2
    again, _ = lb.acquire_server("b", 3, prompt)
    assert again != home
    lb.add_servers({home: "h-new"})  # it comes back empty: the prompt stays where it went since
    assert lb.acquire_server("c", 3, prompt)[0] == again


def test_without_prompt_ids_the_policy_balances_by_load():
    lb = balancer(3)
    chosen = [lb.acquire_server(f"r{i}", 10)[0] for i in range(6)]
    assert sorted(chosen) == ["s0", "s0", "s1", "s1", "s2", "s2"]


def test_a_policy_written_without_prefix_key_still_works():
    class Oldstyle(RoutingPolicy):
        name = "oldstyle"
        seen: list[str] = []

        def select(self, candidates: Sequence[ReplicaView], request_id: str, prompt_len: int) -> str:  # type: ignore[override]
            self.seen.append(request_id)
            return candidates[-1].replica_id

    lb = GlobalRequestLoadBalancer({"a": 1, "b": 2}, policy=Oldstyle())
    assert lb.acquire_server("x", 3, [1, 2, 3])[0] == "b"
    assert Oldstyle.seen == ["x"]


@pytest.mark.parametrize("field, value", [("load_factor", 0.5), ("slack", -1)])
def test_bad_knobs_are_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        get_policy("prefix_affinity", **{field: value})


def grpo_prefill(policy: str, groups: int = 12, samples: int = 8, prompt_len: int = 256) -> tuple[int, int]:
    """Prompt tokens the engines computed for ``groups`` GRPO groups sent at once on 4 virtual
    replicas, and the tokens of the distinct prompts."""
    config = RolloutConfig(
        name="sim",
        num_replicas=4,
        prompt_length=1024,
        response_length=256,
        max_model_len=2048,
        routing={"policy": policy, "seed": 1},
        sim=SimEngineConfig(vocab_size=1000, max_num_seqs=16, mean_response_tokens=40, cache_on_prefill=True),
    )

    async def main() -> int:
        fleet = await VirtualFleet(config).start()
        try:
            prompts = [[3 + (g * 31 + k) % 990 for k in range(prompt_len)] for g in range(groups)]
            await asyncio.gather(
                *(
                    fleet.client.generate(f"g{g}-{i}", prompt_ids=prompts[g], sampling_params={"max_tokens": 64})
                    for g in range(groups)
                    for i in range(samples)
                )
            )
            return (await fleet.report()).prefill_tokens
        finally:
            await fleet.shutdown()

    return virtual_time.run(main()), groups * prompt_len


@pytest.mark.timeout(120)
def test_on_a_virtual_fleet_each_group_prompt_is_prefilled_once_not_on_every_replica():
    affinity, distinct = grpo_prefill("prefix_affinity")
    spread, _ = grpo_prefill("least_tokens")
    assert affinity <= 1.25 * distinct, (affinity, distinct)
    assert spread >= 2 * distinct, (spread, distinct)  # what load-only routing costs


def siblings_spread(routing: dict, full_determinism: bool = False) -> int:
    """How many replicas 8 samples of one prompt land on, through a client built from the config."""
    from rollfleet.client import LLMServerClient

    config = RolloutConfig(name="sim", num_replicas=4, routing=routing, full_determinism=full_determinism)
    client = LLMServerClient(config, servers={f"s{i}": f"h{i}" for i in range(4)})
    prompt = [11, 12, 13]
    return len({client.balancer.acquire_server(f"g-{i}", 3, prompt)[0] for i in range(8)})


def test_the_policys_config_section_reaches_it():
    assert siblings_spread({}) == 1  # the default: prefix_affinity, a group of 8 within the slack
    # no slack, no headroom over the mean: the home gives way as soon as it holds more than the mean
    assert siblings_spread({"prefix_affinity": {"load_factor": 1.0, "slack": 0}}) == 4
    # full_determinism routes by rendezvous hashing on the request id, whatever the section says
    assert siblings_spread({"prefix_affinity": {"slack": 0}}, full_determinism=True) > 1


def test_a_bad_knob_in_the_config_names_its_field():
    with pytest.raises(ValueError, match="prefix_affinity.load_factor"):
        RolloutConfig(name="sim", routing={"prefix_affinity": {"load_factor": 0.5}})
