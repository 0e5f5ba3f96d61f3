"""The tool agent on the real engine: one vLLM CPU replica serving the built-in tiny model.

The tiny model is random, so what it says is noise; the point is that the loop's contract holds on
a real engine whatever it says: it terminates within the budget, masks and logprobs line up, and
the chat template's tokens are accepted by the server. One fleet for the module (a vLLM start-up
costs ~40 s on 2 cores) and one short test.
"""

from __future__ import annotations

import pytest

from rollfleet.agent_loop import AgentLoopManager
from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.config import RollfleetConfig
from rollfleet.manager import LLMServerManager

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

RESPONSE_LENGTH = 96


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
async def vllm_fleet(ray_session):
    config = RollfleetConfig.model_validate(
        {
            "rollout": {
                "name": "vllm",
                "model": "tiny",
                "num_replicas": 1,
                "prompt_length": 512,
                "response_length": RESPONSE_LENGTH,
                "max_model_len": 1024,
                "n": 2,
                "health": {
                    "probe_interval_s": 0.5,
                    "probe_timeout_s": 5.0,
                    "failures_to_dead": 2,
                    "auto_restart": False,
                },
                "retry": {"max_attempts": 40, "initial_backoff_s": 0.05, "max_backoff_s": 0.5},
                "vllm": {"max_num_seqs": 16},
            },
            "agent": {"num_workers": 1, "multi_turn": {"max_assistant_turns": 3, "tool_timeout_s": 5.0}},
        }
    )
    manager = await LLMServerManager.create(config)
    yield config, manager
    await manager.shutdown()


async def test_tool_agent_terminates_within_budget_on_vllm(vllm_fleet, tokenizer):
    config, fleet = vllm_fleet
    agents = await AgentLoopManager.create(
        config, llm_client=fleet.get_client(FullyAsyncLLMServerClient), tokenizer=tokenizer, tools=[add]
    )
    try:
        batch = [
            {
                "raw_prompt": [{"role": "user", "content": f"What is {i} plus 2?"}],
                "agent_name": "tool_agent",
                "reward": {"name": "math", "ground_truth": str(i + 2)},
            }
            for i in range(2)
        ]
        result = await agents.generate_sequences(batch)
    finally:
        await agents.shutdown()
    assert len(result) == 4 and result.responses.shape == (4, RESPONSE_LENGTH)
    for i in range(4):
        extra = result.extra_fields[i]
        n = int(result.response_lengths[i])
        assert 0 < n <= RESPONSE_LENGTH
        assert extra["termination"] in ("no_tool_call", "budget", "max_assistant_turns", "max_user_turns")
        assert extra["stop_reason"] in ("stop", "length")
        assert int(result.num_turns[i]) == extra["assistant_turns"] + extra["user_turns"] + 1 <= 3 + 2 + 1
        mask = result.response_mask[i].tolist()
        logprobs = result.rollout_log_probs[i].tolist()
        assert all(m == 0 for m in mask[n:]) and sum(mask) >= extra["assistant_turns"]
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)
        assert all(lp <= 0.0 for lp in logprobs) and any(lp < 0.0 for lp in logprobs)
        assert len(set(extra["replica_ids"])) == 1
        assert result.has_score[i] and extra["min_global_steps"] is not None
