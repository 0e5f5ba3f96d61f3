"""The loops' control flow on in-process sim replicas (no Ray): masks, logprobs, turns, budgets,
tool failures, aborts and resumes, the worker's scoring, and a local-worker manager."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from agent_loop_helpers import (
    QUESTION,
    THREE_TURNS,
    LocalFleet,
    Recorder,
    add,
    broken,
    hangs,
    lookup,
    mask_runs,
    sim_config,
)

from rollfleet.agent_loop import AgentLoopManager, AgentLoopWorker, BaseTool
from rollfleet.agent_loop.testing import ScriptedTurns
from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.errors import InvalidRequest

pytestmark = pytest.mark.unit


async def make(tokenizer, texts, *, agent=None, rollout=None, sim=None, client_cls=None, tools=None):
    agent_cfg = {"num_workers": 1, "multi_turn": {"tool_timeout_s": 0.3}, **(agent or {})}
    config = sim_config(tokenizer, rollout={"prompt_length": 1024, **(rollout or {})}, agent=agent_cfg, sim=sim)
    fleet = await LocalFleet(config, client_cls=client_cls or FullyAsyncLLMServerClient).start()
    fleet.script(ScriptedTurns.from_texts(tokenizer, texts))
    recorder = Recorder(fleet.client)
    worker = AgentLoopWorker(
        config, client=recorder, tokenizer=tokenizer, tools=tools if tools is not None else [add, lookup, broken, hangs]
    )
    return fleet, recorder, worker


async def test_two_tools_three_turns_masks_logprobs_and_failures(tokenizer):
    fleet, rec, worker = await make(tokenizer, THREE_TURNS)
    out = await worker.run_sample(
        {"raw_prompt": QUESTION, "agent_name": "tool_agent", "reward": {"name": "math", "ground_truth": "5"}}
    )
    # Three assistant turns, two tool rounds: verl's count is user + assistant + 1.
    assert out.num_turns == 6 and len(rec.calls) == 3
    assert out.extra_fields["termination"] == "no_tool_call"
    assert out.extra_fields["tool_errors"] == {"exception": 1, "timeout": 1}
    assert out.metrics.num_tool_calls == 4 and out.metrics.tool_calls >= 0.3
    # Model tokens are exactly the sampled tokens, with their logprobs; the rest is mask 0, logprob 0.
    spans = mask_runs(out.response_mask)
    assert len(spans) == 3
    for (start, end), (_, _, _, tok_out) in zip(spans, rec.calls):
        assert out.response_ids[start:end] == tok_out.token_ids
        assert out.response_logprobs[start:end] == pytest.approx(tok_out.log_probs)
    assert all(lp == 0.0 for lp, m in zip(out.response_logprobs, out.response_mask) if not m)
    # Each turn's prompt is the previous context: one token sequence, extended, never re-rendered.
    for k in (1, 2):
        assert rec.calls[k][1] == out.prompt_ids + out.response_ids[: spans[k][0]]
    text = tokenizer.decode(out.response_ids)
    assert "<tool_response>\n5\n</tool_response>" in text and "value-of-k" in text
    assert "Error: tool 'broken' failed: RuntimeError: the tool broke" in text
    assert "Error: tool 'hangs' timed out after 0.3 s" in text
    # One session key for every turn, one replica, released at the end; the reward was computed.
    assert {c[0] for c in rec.calls} == {out.extra_fields["request_id"]} and rec.finished == [
        c[0] for c in rec.calls[:1]
    ]
    assert len(set(out.extra_fields["replica_ids"])) == 1
    assert fleet.client.get_status()["sticky_sessions"] == 0
    assert out.reward_score == 1.0 and out.extra_fields["reward_extra_info"]["extracted_answer"] == "5"
    await fleet.shutdown()


async def test_budget_bounds_every_turn_and_the_response(tokenizer):
    long_call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "' + "k" * 40 + '"}}\n</tool_call>'
    fleet, rec, worker = await make(tokenizer, [long_call], rollout={"response_length": 150})
    out = await worker.run_sample({"raw_prompt": QUESTION, "agent_name": "tool_agent"})
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs) == 150
    assert out.extra_fields["termination"] == "budget"
    used = 0
    for _, prompt, params, tok_out in rec.calls:
        used = len(prompt) - len(out.prompt_ids)
        assert params["max_tokens"] == 150 - used  # each turn may use exactly what is left
        assert len(tok_out.token_ids) <= params["max_tokens"]
    await fleet.shutdown()


def big(key: str) -> str:
    """Return a long text."""
    return "x " * 500


async def test_a_tool_result_never_takes_the_trajectory_past_max_model_len(tokenizer):
    """``max_model_len`` under prompt + response lengths: only the model's turns were held to it,
    and a 500-token tool result made a 792-token trajectory of a 400-token context, trained on."""
    call = '<tool_call>\n{"name": "big", "arguments": {"key": "k"}}\n</tool_call>'
    fleet, rec, worker = await make(
        tokenizer,
        [call, "done"],
        rollout={"prompt_length": 256, "response_length": 2048, "max_model_len": 400},
        agent={"multi_turn": {"max_tool_response_length": 2000}},
        tools=[big],
    )
    out = await worker.run_sample({"raw_prompt": QUESTION, "agent_name": "tool_agent"})
    assert len(out.prompt_ids) + len(out.response_ids) == 400
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)
    assert out.extra_fields["termination"] == "context_full"
    assert len(rec.calls) == 1  # no turn after the cut
    await fleet.shutdown()


async def test_a_tool_call_the_model_never_closed_is_answered_as_a_bad_call(tokenizer):
    """The model stopped (EOS) inside its call: the trajectory used to end as if it had not tried."""
    unclosed = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}'
    fleet, rec, worker = await make(tokenizer, [unclosed, "It is 2."])
    out = await worker.run_sample({"raw_prompt": QUESTION, "agent_name": "tool_agent"})
    assert len(rec.calls) == 2 and out.extra_fields["termination"] == "no_tool_call"
    assert out.extra_fields["tool_errors"] == {"bad_call": 1}
    assert "never closed" in tokenizer.decode(out.response_ids)
    await fleet.shutdown()


@pytest.mark.parametrize(
    "limits, termination, assistant, user",
    [
        ({"max_assistant_turns": 2}, "max_assistant_turns", 2, 1),
        ({"max_user_turns": 1}, "max_user_turns", 2, 1),
    ],
)
async def test_turn_limits(tokenizer, limits, termination, assistant, user):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>'
    fleet, rec, worker = await make(tokenizer, [call], agent={"multi_turn": {"tool_timeout_s": 0.3, **limits}})
    out = await worker.run_sample({"raw_prompt": QUESTION, "agent_name": "tool_agent"})
    assert out.extra_fields["termination"] == termination
    assert (out.extra_fields["assistant_turns"], out.extra_fields["user_turns"]) == (assistant, user)
    assert out.num_turns == assistant + user + 1
    await fleet.shutdown()


class SessionTool(BaseTool):
    def __init__(self):
        super().__init__({"type": "function", "function": {"name": "session", "parameters": {}}})
        self.created, self.released = [], []

    async def create(self, instance_id, **kwargs):
        self.created.append(kwargs)
        return instance_id

    async def execute(self, instance_id, parameters):
        return "ok", 0.25, {}

    async def release(self, instance_id):
        self.released.append(instance_id)


async def test_tool_instances_released_and_tool_rewards_recorded(tokenizer):
    tool = SessionTool()
    call = '<tool_call>\n{"name": "session", "arguments": {}}\n</tool_call>'
    fleet, rec, worker = await make(tokenizer, [call, call, "done"], tools=[tool])
    out = await worker.run_sample(
        {
            "raw_prompt": QUESTION,
            "agent_name": "tool_agent",
            "tools_kwargs": {"session": {"create_kwargs": {"task": 9}}},
        }
    )
    assert tool.created == [{"task": 9}] and tool.released == [f"{out.extra_fields['request_id']}:session"]
    assert out.extra_fields["tool_rewards"] == [0.25, 0.25]

    class Failing(Recorder):
        async def generate(self, *args, **kwargs):
            if self.calls:
                raise ConnectionError("fleet gone")
            return await super().generate(*args, **kwargs)

    worker.client = worker.context.client = Failing(fleet.client)
    worker._loops.clear()
    with pytest.raises(ConnectionError):
        await worker.run_sample({"raw_prompt": QUESTION, "agent_name": "tool_agent"})
    assert len(tool.released) == 2 and len(worker.client.finished) == 1  # cleaned up even so
    await fleet.shutdown()


async def test_single_turn_loop(tokenizer):
    fleet, rec, worker = await make(tokenizer, ["The answer is 7."], rollout={"response_length": 64})
    out = await worker.run_sample({"raw_prompt": QUESTION, "reward": {"name": "math", "ground_truth": 7}})
    assert out.extra_fields["agent_name"] == "single_turn_agent"
    assert out.num_turns == 2 and out.response_mask == [1] * len(out.response_ids)
    assert tokenizer.decode(out.response_ids, skip_special_tokens=True) == "The answer is 7."
    assert out.reward_score == 1.0 and rec.calls[0][2]["max_tokens"] == 64
    assert rec.calls[0][2]["temperature"] == 1.0 and rec.calls[0][2]["logprobs"] is True
    await fleet.shutdown()


async def test_weight_update_mid_turn_resumes_with_both_versions(tokenizer):
    texts = [
        "thinking " * 60 + '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        "The answer is 5.",
    ]
    # ~4 ms a token: the first turn takes ~0.5 s, the update lands in it.
    fleet, rec, worker = await make(tokenizer, texts, sim={"time_scale": 2.0})
    task = asyncio.ensure_future(worker.run_sample({"raw_prompt": QUESTION, "agent_name": "tool_agent"}))
    await asyncio.sleep(0.15)
    await fleet.replicas[0].update_weights({"w": 1}, 1)
    out = await task
    assert out.extra_fields["termination"] == "no_tool_call"
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (0, 1)
    assert out.metrics.num_resumes >= 1
    assert (
        tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask) if m], skip_special_tokens=True)
        == texts[0] + texts[1]
    )  # resumed, not restarted
    await fleet.shutdown()


async def test_plain_client_abort_ends_the_trajectory(tokenizer):
    from rollfleet.client import LLMServerClient

    fleet, rec, worker = await make(tokenizer, ["thinking " * 60], sim={"time_scale": 2.0}, client_cls=LLMServerClient)
    task = asyncio.ensure_future(worker.run_sample({"raw_prompt": QUESTION, "agent_name": "tool_agent"}))
    await asyncio.sleep(0.15)
    await fleet.replicas[0].update_weights({"w": 1}, 1)
    out = await task
    assert out.extra_fields["termination"] == "aborted" and out.extra_fields["stop_reason"] == "aborted"
    await fleet.shutdown()


async def test_local_manager_batch_groups_and_ragged_prompts(tokenizer):
    config = sim_config(
        tokenizer,
        rollout={"prompt_length": 64, "response_length": 48, "n": 3},
        agent={"num_workers": 2, "default_reward": "math"},
    )
    fleet = await LocalFleet(config, num_replicas=2).start()
    manager = await AgentLoopManager.create(config, llm_client=fleet.client, tokenizer=tokenizer)
    batch = [
        {"prompt_ids": [5, 6, 7], "ground_truth": "1"},
        {"raw_prompt": [{"role": "user", "content": "Copy: the sun " * 3}], "reward": {"ground_truth": "2"}},
        {"prompt_ids": list(range(10, 110))},  # longer than prompt_length: cut on the left
    ]
    result = await manager.generate_sequences(batch)
    assert len(result) == 9 and result.prompts.shape == (9, 64) and result.responses.shape == (9, 48)
    assert result.group_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len(set(result.uid)) == 3 and result.uid[0] == result.uid[2] != result.uid[3]
    assert result.prompts[0, -3:].tolist() == [5, 6, 7] and result.prompt_lengths.tolist()[:3] == [3, 3, 3]
    assert result.prompts[6].tolist() == list(range(46, 110))
    assert result.has_score.tolist() == [True] * 6 + [False] * 3
    assert torch.all(result.response_mask.sum(1) == result.response_lengths)  # single turn: all model tokens
    assert torch.all(result.min_global_steps == 0)
    assert result.num_turns.tolist() == [2] * 9
    assert "agent_loop/generate_sequences/mean" in result.metrics
    await manager.shutdown()
    await fleet.shutdown()


@pytest.mark.parametrize("agent", ["single_turn_agent", "tool_agent"])
async def test_a_turn_that_gave_up_resuming_marks_the_trajectory_for_the_trainer_to_mask(tokenizer, agent):
    """Two tokens, then aborts that bring nothing, max_attempts in a row: the client returns the
    partial turn flagged resume_exhausted. The tool agent dropped the flag, and the trainer
    trained the partial trajectory as if it were whole."""
    from rollfleet.agent_loop.batch import collate
    from tests.client.test_fully_async_client import FakeServer, client

    config = sim_config(tokenizer)
    storm = client(FakeServer([2] + [0] * 100, new_weights=False), max_attempts=3)
    worker = AgentLoopWorker(config, client=storm, tokenizer=tokenizer)
    out = await worker.run_sample({"prompt_ids": [1, 2, 3], "agent_name": agent, "reward": {"score": 1.0}})
    assert len(out.response_ids) == 2 and out.extra_fields["resume_exhausted"] is True
    batch = collate([out], ["u"], prompt_length=8, response_length=16, pad_token_id=0)
    assert batch.resume_exhausted.tolist() == [True]
    await storm.close()


async def test_a_reward_function_that_fails_on_one_sample_leaves_it_unscored_and_the_rest_scored(tokenizer):
    """It failed the whole chunk (8 generations) with it; in sync mode the step and the run."""
    from rollfleet.reward import register_reward

    @register_reward("flaky_judge_for_tests")
    def flaky(solution: str, ground_truth: str, **kwargs: Any) -> float:
        if ground_truth == "boom":
            raise ZeroDivisionError("the judge's bug on one sample")
        return 1.0

    fleet, _, worker = await make(tokenizer, ["The answer is 7."], rollout={"response_length": 16})
    samples = [
        {"raw_prompt": QUESTION, "request_id": f"r{i}",
         "reward": {"name": "flaky_judge_for_tests", "ground_truth": "boom" if i == 3 else "ok"}}
        for i in range(8)
    ]  # fmt: skip
    outs = await worker.generate_sequences(samples)
    assert [o.reward_score for o in outs] == [1.0, 1.0, 1.0, None, 1.0, 1.0, 1.0, 1.0]
    assert "ZeroDivisionError" in outs[3].extra_fields["reward_error"]
    assert all("reward_error" not in o.extra_fields for i, o in enumerate(outs) if i != 3)
    await fleet.shutdown()


@pytest.mark.parametrize(
    "sample, field",
    [
        ({"raw_prompt": "what is 1+2?"}, "raw_prompt"),  # failed in the template: "dictionary update sequence"
        ({"raw_prompt": [{"content": "hi"}]}, "raw_prompt[0]"),
        ({"prompt_ids": "1 2 3"}, "prompt_ids"),  # failed as int(' ')
        ({"prompt_ids": []}, "prompt_ids"),  # went out as an empty prompt
        ({"prompt_ids": [1, "x"]}, "prompt_ids"),
        ({}, "raw_prompt"),
    ],
)
async def test_a_malformed_prompt_is_refused_naming_the_field(tokenizer, sample, field):
    fleet, rec, worker = await make(tokenizer, ["hi"])
    with pytest.raises(InvalidRequest) as err:
        await worker.run_sample({**sample, "agent_name": "single_turn_agent"})
    assert err.value.field == field and rec.calls == []
    await fleet.shutdown()


async def test_a_prompt_as_a_datasets_array_of_messages_is_taken(tokenizer):
    np = pytest.importorskip("numpy")
    fleet, rec, worker = await make(tokenizer, ["hi"])
    out = await worker.run_sample({"raw_prompt": np.array(QUESTION, dtype=object), "agent_name": "single_turn_agent"})
    assert len(rec.calls) == 1 and out.response_ids
    await fleet.shutdown()


@pytest.mark.parametrize("agent", ["single_turn_agent", "tool_agent"])
@pytest.mark.parametrize("key", ["max_tokens", "max_new_tokens"])
async def test_a_samples_own_budget_bounds_its_trajectory(tokenizer, agent, key):
    """A sample's max_tokens was overwritten with the whole response_length; its max_new_tokens
    was refused as differing from the max_tokens the loop set beside it."""
    fleet, rec, worker = await make(tokenizer, ["one two three four five six seven eight nine ten " * 4])
    out = await worker.run_sample({"raw_prompt": QUESTION, "agent_name": agent, "sampling_params": {key: 6}})
    assert len(out.response_ids) <= 6 and len(rec.calls) == 1
    assert rec.calls[0][2]["max_tokens"] == 6 and "max_new_tokens" not in rec.calls[0][2]
    with pytest.raises(InvalidRequest) as err:
        await worker.run_sample(
            {"raw_prompt": QUESTION, "agent_name": agent, "sampling_params": {"max_tokens": 6, "max_new_tokens": 7}}
        )
    assert err.value.field == "sampling_params.max_new_tokens"
    await fleet.shutdown()


async def test_siblings_of_a_sample_with_its_own_request_id_each_get_their_own_tool_instance(tokenizer):
    """A GRPO group's copies kept the sample's request_id: one tool instance for all of them, each
    sibling counting on the other's state, the first to end releasing it under the other."""

    class Counter(BaseTool):
        def __init__(self) -> None:
            super().__init__({"type": "function", "function": {"name": "incr", "description": "count",
                                                               "parameters": {"type": "object", "properties": {}}}})  # fmt: skip
            self.state: dict[str, int] = {}
            self.created: list[str] = []

        async def create(self, instance_id: str, **kwargs: Any) -> str:
            self.created.append(instance_id)
            self.state[instance_id] = 0
            return instance_id

        async def execute(self, instance_id: str, parameters: dict[str, Any]) -> str:
            await asyncio.sleep(0.05)  # the siblings' calls interleave
            self.state[instance_id] += 1
            return f"count={self.state[instance_id]}"

        async def release(self, instance_id: str) -> None:
            self.state.pop(instance_id)

    counter = Counter()
    config = sim_config(tokenizer, rollout={"prompt_length": 1024, "n": 2},
                        agent={"num_workers": 1, "multi_turn": {"tool_timeout_s": 2}})  # fmt: skip
    fleet = await LocalFleet(config).start()
    call = '<tool_call>\n{"name": "incr", "arguments": {}}\n</tool_call>'
    fleet.script(ScriptedTurns.from_texts(tokenizer, [call, call, "done"]))
    manager = await AgentLoopManager.create(config, llm_client=fleet.client, tokenizer=tokenizer, tools=[counter])
    batch = await manager.generate_sequences(
        [{"raw_prompt": QUESTION, "agent_name": "tool_agent", "request_id": "row-17"}]
    )
    assert [e["request_id"] for e in batch.extra_fields] == ["row-17-0", "row-17-1"]
    assert sorted(counter.created) == ["row-17-0:incr", "row-17-1:incr"] and counter.state == {}
    for i in range(len(batch)):
        text = tokenizer.decode(batch.responses[i][: int(batch.response_lengths[i])].tolist())
        assert "count=1" in text and "count=2" in text and "count=3" not in text, text
        assert batch.extra_fields[i]["tool_errors"] == {}
    await manager.shutdown()
    await fleet.shutdown()


async def test_sync_tools_that_hang_hold_up_no_other_tool_call(tokenizer):
    """Each hung call kept a thread of the loop's shared pool: once they held every thread, every
    later sync tool call timed out without running (and ran later, after the model was told so)."""
    import os
    import threading

    release = threading.Event()
    ran: list[str] = []

    def stuck(x: str) -> str:
        """A tool whose backend stopped answering."""
        release.wait(30)
        return "late"

    def quick(x: str) -> str:
        """Answers at once."""
        ran.append(x)
        return "quick-ok"

    hung = min(32, (os.cpu_count() or 1) + 4) + 2  # more than the loop's default pool has threads
    fleet, _, worker = await make(
        tokenizer,
        ['<tool_call>\n{"name": "stuck", "arguments": {"x": "1"}}\n</tool_call>', "done"],
        agent={"max_concurrent_trajectories": 64},
        tools=[stuck, quick],
    )
    try:
        outs = await worker.generate_sequences([{"raw_prompt": QUESTION, "agent_name": "tool_agent"}] * hung)
        assert all(o.extra_fields["tool_errors"] == {"timeout": 1} for o in outs)
        fleet.script(
            ScriptedTurns.from_texts(
                tokenizer, ['<tool_call>\n{"name": "quick", "arguments": {"x": "1"}}\n</tool_call>', "done"]
            )
        )
        outs = await worker.generate_sequences([{"raw_prompt": QUESTION, "agent_name": "tool_agent"}] * 3)
        assert [o.extra_fields["tool_errors"] for o in outs] == [{}] * 3 and len(ran) == 3
    finally:
        release.set()
        await fleet.shutdown()


async def test_a_minimum_over_a_later_turns_room_is_lowered_to_it_not_refused(tokenizer):
    """A sample's ``min_tokens`` went unchanged to every turn: once a turn's room fell below it, the
    replica refused the request (min_tokens <= max_tokens) and the trajectory failed, its batch
    with it. A turn now asks for at most its room."""
    from rollfleet.client import LLMServerClient

    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k"}}\n</tool_call>'
    config = sim_config(tokenizer, rollout={"prompt_length": 1024, "response_length": 200}, agent={"num_workers": 1})
    fleet = await LocalFleet(config, client_cls=LLMServerClient).start()
    fleet.script(ScriptedTurns.from_texts(tokenizer, [call, call, call, "The answer is 5"]))
    rec = Recorder(fleet.client)
    worker = AgentLoopWorker(config, client=rec, tokenizer=tokenizer, tools=[add, lookup])
    out = await worker.run_sample(
        {"raw_prompt": QUESTION, "agent_name": "tool_agent", "sampling_params": {"min_tokens": 190}}
    )
    assert len(rec.calls) >= 2 and len(out.response_ids) > 0
    for _, _, params, _ in rec.calls:
        assert params["min_tokens"] == min(190, params["max_tokens"])
    assert rec.calls[1][2]["max_tokens"] < 190  # a later turn's room, under the sample's minimum
    await fleet.shutdown()


async def test_a_tool_instance_whose_create_outlived_its_call_is_released_when_the_trajectory_ends(tokenizer):
    """The create() of a slow sandbox ran past ``tool_timeout_s`` (kept running, shielded); at the
    trajectory's end it was cancelled and never released: a sandbox it had begun to allocate leaked."""
    from rollfleet.client import LLMServerClient

    live: set[str] = set()

    class Sandbox(BaseTool):
        def __init__(self) -> None:
            super().__init__(
                {
                    "type": "function",
                    "function": {"name": "sb", "description": "d", "parameters": {"type": "object", "properties": {}}},
                }
            )

        async def create(self, instance_id: str, **kwargs: Any) -> str:
            live.add(instance_id)  # allocated, then slow to become ready
            await asyncio.sleep(0.3)
            return instance_id

        async def execute(self, instance_id: str, parameters: dict[str, Any]) -> str:
            return "ok"

        async def release(self, instance_id: str) -> None:
            live.discard(instance_id)

    call = '<tool_call>\n{"name": "sb", "arguments": {}}\n</tool_call>'
    config = sim_config(
        tokenizer,
        rollout={"prompt_length": 1024, "response_length": 400},
        agent={"num_workers": 1, "multi_turn": {"tool_timeout_s": 0.1}},
    )
    fleet = await LocalFleet(config, client_cls=LLMServerClient).start()
    fleet.script(ScriptedTurns.from_texts(tokenizer, [call, "done"]))
    worker = AgentLoopWorker(config, client=fleet.client, tokenizer=tokenizer, tools=[Sandbox()])
    out = await worker.run_sample({"raw_prompt": QUESTION, "agent_name": "tool_agent"})
    assert out.extra_fields["tool_errors"] == {"timeout": 1}
    assert live == set()  # released by the time the trajectory is back
    await fleet.shutdown()
