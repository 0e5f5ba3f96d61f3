"""``rollfleet train`` with ``http_agent``: an OpenAI-SDK agent in the worker actors, the real tiny
learner, simulated replicas. The agent's reward is scripted to rise with the weight version that
sampled its reply (simulated tokens do not come from the model, so a real reward could not rise
here); what the test proves is the loop: weights reach the fleet, the agent's HTTP session is
captured, its reward reaches the learner, and every trainer mode trains it unchanged."""

from __future__ import annotations

import pytest
from test_modes import run
from trainer_support import sim_train_config

pytestmark = pytest.mark.ray

STEPS = 10
AGENT = f"""
from openai import AsyncOpenAI

async def solve(run):
    client = AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0)
    out = await client.chat.completions.create(
        model=run.model, messages=run.sample["raw_prompt"], max_tokens=8, extra_body={{"return_token_ids": True}}
    )
    await client.close()
    version = out.choices[0].model_extra.get("max_weight_version") or 0
    return min(1.0, version / {STEPS})
"""


@pytest.mark.parametrize("mode", ["sync", "separate_async"])
async def test_an_http_agent_trains_and_its_reward_rises_with_the_weights_it_ran_on(ray_session, tmp_path, mode):
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    cfg = sim_train_config(tmp_path, mode, total_steps=STEPS)
    cfg.agent.default_agent_loop = "http_agent"
    cfg.agent.http_agent.agent = f"{agent}:solve"
    trainer = await run(cfg)
    rows = trainer.tracker.history
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert trainer.params_changed and all("actor/pg_loss" in r for r in rows)
    rewards = [r["reward/mean"] for r in rows]
    fifth = STEPS // 5
    first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
    assert last > first + 0.3, rewards
