"""Agent loops on a Ray sim fleet: Ray workers building their own clients, tool calls made to
appear with ``script_responses``, a weight update mid-turn, streaming groups, and a foreign agent
framework sharing the fleet with rollfleet's loops."""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib
import sys
import time

import pytest
from agent_loop_helpers import QUESTION, THREE_TURNS, add, broken, hangs, lookup, mask_runs, sim_config

from rollfleet.agent_loop import FullyAsyncAgentLoopManager
from rollfleet.agent_loop.testing import ScriptedTurns
from rollfleet.manager import LLMServerManager

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_pickles_this_module(ray_session):
    """Tools defined in test modules travel to worker actors by value (pytest's modules are not
    importable there)."""
    modules = [sys.modules[__name__], sys.modules["agent_loop_helpers"]]
    for module in modules:
        ray_session.cloudpickle.register_pickle_by_value(module)
    yield
    for module in modules:
        ray_session.cloudpickle.unregister_pickle_by_value(module)


@pytest.fixture(scope="module")
def config(tokenizer):
    return sim_config(
        tokenizer,
        rollout={"num_replicas": 2, "prompt_length": 1024, "response_length": 256, "n": 2},
        agent={"num_workers": 2, "multi_turn": {"tool_timeout_s": 0.3}, "default_reward": "math"},
        sim={"time_scale": 5.0},
    )


@pytest.fixture(scope="module")
async def fleet(ray_session, config):
    manager = await LLMServerManager.create(config)
    yield manager
    await manager.shutdown()


@pytest.fixture(scope="module")
async def agents(fleet, config, ray_pickles_this_module):
    """One set of Ray workers for the module (an actor start costs seconds on 2 cores). The
    fully-async manager is a plain ``AgentLoopManager`` whose workers build resuming clients."""
    manager = await FullyAsyncAgentLoopManager.create(config, server_manager=fleet, tools=[add, lookup, broken, hangs])
    yield manager
    await manager.shutdown()


async def test_tool_agent_on_ray_workers(fleet, agents, tokenizer):
    await fleet.script_responses(ScriptedTurns.from_texts(tokenizer, THREE_TURNS))
    batch = [{"raw_prompt": QUESTION, "agent_name": "tool_agent", "reward": {"ground_truth": "5"}}] * 3
    result = await agents.generate_sequences(batch)
    assert len(result) == 6 and result.responses.shape == (6, 256) and result.prompts.shape == (6, 1024)
    assert result.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert result.num_turns.tolist() == [6] * 6
    assert result.scores.tolist() == [1.0] * 6
    for i in range(6):
        extra = result.extra_fields[i]
        assert extra["termination"] == "no_tool_call"
        assert extra["tool_errors"] == {"exception": 1, "timeout": 1}
        assert len(set(extra["replica_ids"])) == 1  # every turn on one replica
        n = int(result.response_lengths[i])
        mask = result.response_mask[i, :n].tolist()
        assert len(mask_runs(mask)) == 3
        logprobs = result.rollout_log_probs[i, :n].tolist()
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)
        assert sum(lp != 0.0 for lp, m in zip(logprobs, mask) if m) >= sum(mask) - 2
        text = tokenizer.decode(result.responses[i, :n].tolist())
        assert "value-of-k" in text and "timed out" in text and "the tool broke" in text
    assert result.rm_scores.sum().item() == 6.0
    assert result.metrics["agent_loop/tool_calls/min"] >= 0.3  # every trajectory waited for the hung tool


@pytest.mark.parametrize("mode", ["abort", "keep"])
async def test_weight_update_mid_turn_streams_groups(fleet, agents, tokenizer, mode):
    """abort: the first turns are interrupted and resumed; keep: they continue, and the batch says
    which version sampled every token."""
    texts = [
        "thinking " * 80 + '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        "The answer is 5.",
    ]
    await fleet.script_responses(ScriptedTurns.from_texts(tokenizer, texts))
    version = (await fleet.status()).current_version
    assert len(await agents.get_replicas()) == 2
    prompts = [{"raw_prompt": QUESTION, "agent_name": "tool_agent", "reward": {"ground_truth": "5"}}] * 3
    groups = []

    async def consume():
        async for group in agents.stream_groups(prompts):
            groups.append(group)

    before = await fleet.replica_stats()
    consumer = asyncio.ensure_future(consume())

    async def first_turns_running():
        now = await fleet.replica_stats()
        return sum(now[r]["requests"] - before[r]["requests"] for r in now) >= 6

    deadline = time.perf_counter() + 30
    while not await first_turns_running():  # a first turn (~250 tokens) takes >= 0.35 s here
        assert time.perf_counter() < deadline and not consumer.done()
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    await fleet.update_weights({"step": version + 1}, version + 1, mode)
    await consumer
    assert agents.inflight == [0, 0]
    assert len(groups) == 3
    for group in groups:
        assert len(group) == 2 and len(set(group.uid)) == 1
        assert group.scores.tolist() == [1.0, 1.0]
        assert all(e["termination"] == "no_tool_call" for e in group.extra_fields)
        assert (group.max_global_steps == version + 1).all()
    lows = [int(v) for g in groups for v in g.min_global_steps]
    assert lows == [version] * 6, "the update landed in every trajectory's first turn"
    if mode == "abort":
        assert min(g.metrics["agent_loop/num_resumes/min"] for g in groups) >= 1
    else:
        assert max(g.metrics["agent_loop/num_resumes/max"] for g in groups) == 0
        for g in groups:
            model = g.response_mask.bool()
            assert (g.token_versions[~model] == -1).all()
            for row, mask in zip(g.token_versions, model):
                sampled = row[mask].tolist()
                assert sampled == sorted(sampled) and sampled[0] == version and sampled[-1] == version + 1


def load_example():
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "foreign_agent_framework.py"
    spec = importlib.util.spec_from_file_location("foreign_agent_framework", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_foreign_framework_shares_the_fleet(fleet, agents, tokenizer):
    foreign = load_example()
    await fleet.script_responses(ScriptedTurns.from_texts(tokenizer, THREE_TURNS))
    client = fleet.get_client()
    before = await fleet.replica_stats()
    spans = {}

    async def timed(name, coro):
        start = time.perf_counter()
        result = await coro
        spans[name] = (start, time.perf_counter())
        return result

    ours, theirs = await asyncio.gather(
        timed("rollfleet", agents.generate_sequences([{"raw_prompt": QUESTION, "agent_name": "tool_agent"}] * 8)),
        timed("foreign", foreign.run_agents(client, tokenizer, [f"What is {i}+1?" for i in range(16)])),
    )
    assert len(ours) == 16 and all(e["termination"] == "no_tool_call" for e in ours.extra_fields)
    assert len(theirs) == 16 and all(len(r["turns"]) == 2 for r in theirs)
    # Sticky unless the replica was overloaded (then the balancer lets a session spill over).
    switched = sum(len({t["replica_id"] for t in r["turns"]}) > 1 for r in theirs)
    assert switched <= client.balancer.decisions["spill_over"]
    assert all(t["stop_reason"] == "stop" for r in theirs for t in r["turns"])
    (a0, a1), (b0, b1) = spans["rollfleet"], spans["foreign"]
    assert a0 < b1 and b0 < a1  # they really ran at the same time
    after = await fleet.replica_stats()
    served = {r for r in after if after[r]["num_finished"] > before[r]["num_finished"]}
    assert len(served) == 2
    assert client.get_status()["sticky_sessions"] == 0
