"""``http_agent``: an agent that only speaks the OpenAI API (the example agent, the real ``openai``
client) is run per sample against the worker's own gateway, and its trajectory comes back as the
exact tokens the fleet was prompted with and sampled (in-process sim replicas, no Ray)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from agent_loop_helpers import LocalFleet, Recorder, mask_runs, sim_config

from rollfleet.agent_loop import AgentLoopWorker
from rollfleet.agent_loop.testing import ScriptedTurns
from rollfleet.agent_loop.worker import model_text
from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.trainer.tasks import count_continuation

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_sdk_agent.py"
SAMPLE = {
    "raw_prompt": [{"role": "user", "content": "Count: 3 4 5"}],
    "reward": {"name": "rollfleet.trainer.tasks:count_continuation", "ground_truth": "6 7 8 9"},
}
TOOL_THEN_ANSWER = ['<tool_call>\n{"name": "next_numbers", "arguments": {"n": 5, "k": 4}}\n</tool_call>', "6 7 8 9"]


async def make(tokenizer, texts, http_agent):
    config = sim_config(
        tokenizer,
        rollout={"prompt_length": 1024, "response_length": 512},
        agent={"num_workers": 1, "default_agent_loop": "http_agent", "http_agent": http_agent},
    )
    fleet = await LocalFleet(config, client_cls=FullyAsyncLLMServerClient).start()
    fleet.script(ScriptedTurns.from_texts(tokenizer, texts))
    recorder = Recorder(fleet.client)
    return fleet, recorder, AgentLoopWorker(config, client=recorder, tokenizer=tokenizer)


@pytest.mark.parametrize("how", ["callable", "command"])
async def test_the_openai_sdk_example_is_trained_from_the_tokens_the_fleet_saw(tokenizer, how):
    """Two model turns (a tool call, then the answer): the output's model spans are the fleet's
    sampled ids with their logprobs, every turn's prompt is the same sequence extended (no
    re-rendering), and the sample's verifiable reward scores the model's text."""
    agent = {"agent": f"{EXAMPLE}:solve"} if how == "callable" else {"command": ["{python}", str(EXAMPLE)]}
    fleet, rec, worker = await make(tokenizer, TOOL_THEN_ANSWER, agent)
    out = await worker.run_sample(dict(SAMPLE))
    assert out.num_turns == 4 and len(rec.calls) == 2 and out.metrics.num_generate_calls == 2
    spans = mask_runs(out.response_mask)
    assert len(spans) == 2
    for (start, end), (_, prompt, _, sampled) in zip(spans, rec.calls):
        assert out.response_ids[start:end] == sampled.token_ids
        assert out.response_logprobs[start:end] == pytest.approx(sampled.log_probs)
        assert prompt == out.prompt_ids + out.response_ids[:start]
    assert "<tool_response>\n6 7 8 9\n</tool_response>" in tokenizer.decode(out.response_ids)  # the tool ran
    assert out.reward_score == pytest.approx(count_continuation(model_text(out, tokenizer), "6 7 8 9"))
    assert out.response_versions is not None and set(out.response_versions[spans[0][0] : spans[0][1]]) == {0}
    gateway = worker.loop_for("http_agent")._gateway.gateway
    assert len(gateway.trajectories) == 0 and fleet.client.get_status()["sticky_sessions"] == 0
    await worker.close()
    await fleet.shutdown()


async def test_rewards_from_the_agent_and_its_failures(tokenizer, tmp_path):
    agents = tmp_path / "agents.py"
    agents.write_text(
        "import httpx\n"
        "from openai import AsyncOpenAI\n\n"
        "async def ask(run):\n"
        "    c = AsyncOpenAI(base_url=run.base_url, api_key=run.api_key)\n"
        "    await c.chat.completions.create(model=run.model, messages=run.sample['raw_prompt'], max_tokens=8)\n\n"
        "async def returns(run):\n"
        "    await ask(run)\n"
        "    return 0.25\n\n"
        "async def posts(run):\n"
        "    await ask(run)\n"
        "    async with httpx.AsyncClient() as h:\n"
        "        r = await h.post(run.reward_url, json={'reward': 0.75}, headers={'X-Rollfleet-Session-Key': run.api_key})\n"
        "        r.raise_for_status()\n\n"
        "async def crashes(run):\n"
        "    await ask(run)\n"
        "    raise ValueError('the sandbox died')\n\n"
        "def silent(run):\n"
        "    return 1.0\n\n"
        "def blocking(run):  # a synchronous agent with a blocking client\n"
        "    import openai\n"
        "    c = openai.OpenAI(base_url=run.base_url, api_key=run.api_key)\n"
        "    c.chat.completions.create(model=run.model, messages=run.sample['raw_prompt'], max_tokens=8)\n"
        "    return 0.5\n"
    )
    for name, reward in (("returns", 0.25), ("posts", 0.75), ("crashes", 0.0), ("blocking", 0.5)):
        fleet, _, worker = await make(tokenizer, ["6 7 8 9"], {"agent": f"{agents}:{name}"})
        out = await worker.run_sample(dict(SAMPLE))
        assert out.reward_score == reward, name
        assert ("agent_error" in out.extra_fields) == (name == "crashes")
        if name == "crashes":
            assert "the sandbox died" in out.extra_fields["agent_error"]
        await worker.close()
        await fleet.shutdown()
    fleet, _, worker = await make(tokenizer, ["6 7 8 9"], {"agent": f"{agents}:silent"})
    with pytest.raises(RuntimeError, match="made no chat request"):
        await worker.run_sample(dict(SAMPLE))
    await worker.close()
    await fleet.shutdown()
    with pytest.raises(ValueError, match="exactly one of"):
        config = sim_config(tokenizer, agent={"default_agent_loop": "http_agent"})
        AgentLoopWorker(config, client=fleet.client, tokenizer=tokenizer).loop_for("http_agent")


async def test_a_turn_the_gateway_gave_up_resuming_marks_the_trajectory_for_the_trainer_to_mask(tokenizer):
    """The gateway resumes aborted turns itself; a turn it answered with finish_reason "abort"
    (two tokens, then aborts that brought nothing, max_attempts in a row) is a partial: the
    trainer masks such trajectories out by ``resume_exhausted``, which the http agent did not set."""
    from tests.client.test_fully_async_client import FakeServer, client

    config = sim_config(
        tokenizer,
        rollout={"prompt_length": 1024, "response_length": 512},
        agent={"num_workers": 1, "default_agent_loop": "http_agent", "http_agent": {"agent": f"{EXAMPLE}:solve"}},
    )
    storm = client(FakeServer([2] + [0] * 100, new_weights=False), max_attempts=3)
    worker = AgentLoopWorker(config, client=storm, tokenizer=tokenizer)
    out = await worker.run_sample(dict(SAMPLE))
    assert out.extra_fields["resume_exhausted"] is True
    assert sum(out.response_mask) == 2
    await worker.close()
    await storm.close()


async def test_synchronous_agents_run_at_once_each_within_its_own_timeout(tokenizer, tmp_path):
    """On the loop's default executor (6 threads on 2 cores) 30 one-second agents queued for a
    thread (5 rounds) with their timeouts running: the late ones were cut off, or never started."""
    agents = tmp_path / "slow_agents.py"
    agents.write_text(
        "import time, openai\n\n"
        "def slow(run):\n"
        "    time.sleep(1.0)  # a synchronous agent thinking\n"
        "    c = openai.OpenAI(base_url=run.base_url, api_key=run.api_key)\n"
        "    c.chat.completions.create(model=run.model, messages=run.sample['raw_prompt'], max_tokens=4)\n"
        "    return 1.0\n"
    )
    fleet, _, worker = await make(tokenizer, ["6 7 8 9"], {"agent": f"{agents}:slow", "timeout_s": 3.5})
    outs = await asyncio.gather(*(worker.run_sample(dict(SAMPLE)) for _ in range(30)))
    assert [o.extra_fields.get("agent_error") for o in outs] == [None] * 30
    assert all(o.reward_score == 1.0 for o in outs)
    await worker.close()
    await fleet.shutdown()


async def test_request_ids_a_url_path_misreads_rewards_that_are_not_finite_and_the_gateway_section(tokenizer, tmp_path):
    """A dataset id like ``gsm8k/train/17`` went into the session's URL as it was: no route
    matched, the agent got 404s and its whole batch failed. A NaN or infinite reward, returned or
    printed (JSON's ``NaN``), became the sample's score: NaN advantages. The worker's gateway
    ignored the config's ``gateway`` section (its parser, model name)."""
    from rollfleet.config import GatewayConfig

    agents = tmp_path / "odd_agents.py"
    agents.write_text(
        "from openai import AsyncOpenAI\n\n"
        "async def ask(run):\n"
        "    c = AsyncOpenAI(base_url=run.base_url, api_key=run.api_key)\n"
        "    await c.chat.completions.create(model=run.model, messages=run.sample['raw_prompt'], max_tokens=8)\n\n"
        "async def nan(run):\n"
        "    await ask(run)\n"
        "    return float('nan')\n\n"
        "async def named(run):\n"
        "    await ask(run)\n"
        "    return 1.0 if run.model == 'my-policy' else 0.5\n"
    )
    command = tmp_path / "nan_command.py"
    command.write_text(
        "import json, os\n"
        "from openai import OpenAI\n"
        "OpenAI().chat.completions.create(model=os.environ['ROLLFLEET_MODEL'],\n"
        "    messages=json.loads(os.environ['ROLLFLEET_SAMPLE'])['raw_prompt'], max_tokens=8)\n"
        "print('{\"reward\": Infinity}')\n"
    )
    fleet, _, worker = await make(tokenizer, ["6 7 8 9"], {"agent": f"{agents}:named"})
    worker.context.gateway = GatewayConfig(served_model_name="my-policy", tool_call_parser="qwen3")
    for rid in ("gsm8k/train/17", "q?1", "a b#c", "%2F..", "x" * 300):
        out = await worker.run_sample({**SAMPLE, "request_id": rid})
        assert out.extra_fields.get("agent_error") is None and out.reward_score == 1.0, rid
    gateway = worker.loop_for("http_agent")._gateway.gateway
    assert gateway.config.tool_call_parser == "qwen3" and gateway.config.host == "127.0.0.1"
    assert gateway.config.capture_trajectories is True
    await worker.close()
    await fleet.shutdown()
    for agent in ({"agent": f"{agents}:nan"}, {"command": ["{python}", str(command)]}):
        fleet, _, worker = await make(tokenizer, ["6 7 8 9"], agent)
        out = await worker.run_sample(dict(SAMPLE))
        assert out.reward_score == 0.0 and "finite" in out.extra_fields["agent_error"], agent
        await worker.close()
        await fleet.shutdown()


async def test_an_agent_that_outlives_its_run_generates_nothing_more_and_leaves_nothing_running(tokenizer, tmp_path):
    """A synchronous agent cannot be stopped: past its timeout it sent its request anyway, the
    fleet generated it in full and the gateway opened the ended session again (a record nobody
    reads). Now the session is closed when the run ends: 409 ``session_ended``, nothing generated.
    A command's children were left running (only the program was killed); now its whole process
    group goes. A cancelled run left its session and sticky entry behind; now it closes them."""
    marker = tmp_path / "grandchild_alive"
    agents = tmp_path / "late_agents.py"
    agents.write_text(
        "import sys, time, openai\n\n"
        "def late(run):\n"
        "    time.sleep(1.0)  # past the run's timeout\n"
        "    c = openai.OpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0)\n"
        "    try:\n"
        "        c.chat.completions.create(model=run.model, messages=run.sample['raw_prompt'], max_tokens=4)\n"
        "        outcome = 'answered'\n"
        "    except openai.APIStatusError as exc:\n"
        "        outcome = f'{exc.status_code} {exc.body.get(\"code\")}'\n"
        f"    open({str(tmp_path / 'outcome')!r}, 'w').write(outcome)\n\n"
        "async def asks_then_waits(run):\n"
        "    import asyncio\n"
        "    c = openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key)\n"
        "    await c.chat.completions.create(model=run.model, messages=run.sample['raw_prompt'], max_tokens=4)\n"
        "    await asyncio.sleep(60)\n"
    )
    child = tmp_path / "child.py"
    child.write_text(f"import time\ntime.sleep(2.5)\nopen({str(marker)!r}, 'w')\n")
    spawner = tmp_path / "spawner.py"
    spawner.write_text(
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, {str(child)!r}])\n"
        f"open({str(tmp_path / 'spawned')!r}, 'w')\n"
        "time.sleep(60)\n"
    )
    fleet, rec, worker = await make(tokenizer, ["6 7 8 9"], {"agent": f"{agents}:late", "timeout_s": 0.3})
    gateway_of = lambda: worker.loop_for("http_agent")._gateway.gateway  # noqa: E731
    with pytest.raises(RuntimeError, match="made no chat request"):
        await worker.run_sample(dict(SAMPLE))
    for _ in range(100):
        if (tmp_path / "outcome").exists():
            break
        await asyncio.sleep(0.05)
    assert (tmp_path / "outcome").read_text() == "409 session_ended"
    assert rec.calls == [] and len(gateway_of().trajectories) == 0
    await worker.close()
    await fleet.shutdown()

    fleet, rec, worker = await make(tokenizer, ["6 7 8 9"], {"agent": f"{agents}:asks_then_waits"})
    task = asyncio.ensure_future(worker.run_sample(dict(SAMPLE)))
    while not rec.calls:
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(gateway_of().trajectories) == 0 and fleet.client.get_status()["sticky_sessions"] == 0
    await worker.close()
    await fleet.shutdown()

    fleet, _, worker = await make(tokenizer, ["6 7 8 9"], {"command": ["{python}", str(spawner)], "timeout_s": 1.5})
    with pytest.raises(RuntimeError, match="made no chat request"):
        await worker.run_sample(dict(SAMPLE))
    assert (tmp_path / "spawned").exists()  # the program started its child before it was stopped
    await asyncio.sleep(3.0)  # the child would have written its marker by now
    assert not marker.exists()
    await worker.close()
    await fleet.shutdown()
