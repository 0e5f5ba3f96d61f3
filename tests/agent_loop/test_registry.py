"""The agent-loop registry: decorator, lookup errors, YAML of import paths (verl's format)."""

from __future__ import annotations

import pytest

from rollfleet.agent_loop import AgentLoopBase, get_agent_loop, list_agent_loops, load_agent_loop_config, register

pytestmark = pytest.mark.unit


def test_builtins_and_error_lists_valid_names():
    assert {"single_turn_agent", "tool_agent"} <= set(list_agent_loops())
    with pytest.raises(KeyError) as info:
        get_agent_loop("no_such_loop")
    assert "single_turn_agent" in str(info.value) and "tool_agent" in str(info.value)


def test_register_rejects_non_loops():
    with pytest.raises(TypeError):
        register("bad")(object)


def test_yaml_entries_resolve_lazily_with_kwargs(tmp_path):
    path = tmp_path / "loops.yaml"
    path.write_text(
        "- name: yaml_single\n"
        "  _target_: rollfleet.agent_loop.single_turn.SingleTurnAgentLoop\n"
        "  flavour: 3\n"
        "- name: yaml_typo\n"
        "  _target_: rollfleet.agent_loop.nope.Missing\n"
        "- name: yaml_not_a_loop\n"
        "  class: rollfleet.reward.rules:exact_match\n"
    )
    assert load_agent_loop_config(str(path)) == ["yaml_single", "yaml_typo", "yaml_not_a_loop"]
    spec = get_agent_loop("yaml_single")
    assert issubclass(spec.resolve(), AgentLoopBase) and spec.kwargs == {"flavour": 3}
    with pytest.raises(ModuleNotFoundError):
        get_agent_loop("yaml_typo").resolve()
    with pytest.raises(TypeError):
        get_agent_loop("yaml_not_a_loop").resolve()


async def test_a_per_trajectory_loop_is_closed_when_its_trajectory_ends(tokenizer):
    """Built for one trajectory, it is closed with it, failed or not: the worker's close reaches
    only the loops it keeps, so what such a loop started (a server) leaked once per trajectory."""
    from rollfleet.agent_loop import AgentLoopOutput, AgentLoopWorker
    from rollfleet.agent_loop.registry import AGENT_LOOPS
    from rollfleet.config import RollfleetConfig

    closed: list[str] = []

    class OnePerTrajectory(AgentLoopBase):
        per_trajectory = True

        async def run(self, sampling_params, **sample):
            if sample.get("fail"):
                raise RuntimeError("the trajectory failed")
            return AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], num_turns=2)

        async def close(self):
            closed.append("closed")

    register("test_one_per_trajectory")(OnePerTrajectory)
    try:
        config = RollfleetConfig.model_validate(
            {"rollout": {"name": "sim", "model": "tiny"}, "agent": {"default_agent_loop": "test_one_per_trajectory"}}
        )
        worker = AgentLoopWorker(config, client=object(), tokenizer=tokenizer, owns_client=False)
        for _ in range(3):
            await worker.run_sample({"prompt_ids": [1]})
        with pytest.raises(RuntimeError, match="failed"):
            await worker.run_sample({"prompt_ids": [1], "fail": True})
        assert closed == ["closed"] * 4
        await worker.close()
        assert closed == ["closed"] * 4  # nothing kept to close twice
    finally:
        AGENT_LOOPS.unregister("test_one_per_trajectory")


@pytest.mark.parametrize("given", ["spec", "loop", "function"])
def test_a_reward_that_is_not_finite_leaves_the_sample_unscored(tokenizer, given, monkeypatch):
    """A NaN score (given outright, set by the loop, or computed) went into the batch: its group's
    advantages, the loss and so the whole step came out NaN. It is an unscored sample now, with
    the reason, as a reward function that raises."""
    from rollfleet.agent_loop import AgentLoopOutput, AgentLoopWorker
    from rollfleet.agent_loop import worker as worker_module
    from rollfleet.config import RollfleetConfig
    from rollfleet.reward import RewardResult

    config = RollfleetConfig.model_validate({"rollout": {"name": "sim", "model": "tiny"}})
    worker = AgentLoopWorker(config, client=object(), tokenizer=tokenizer, owns_client=False)
    out = AgentLoopOutput(prompt_ids=[1], response_ids=[5], response_mask=[1], num_turns=2)
    sample: dict = {"reward": {"score": float("nan")}}
    if given == "loop":
        out.reward_score, sample = float("inf"), {}
    elif given == "function":
        monkeypatch.setattr(worker_module, "compute_reward", lambda *a: RewardResult(float("nan"), {}))
        sample = {"ground_truth": "7"}
    worker.score(out, sample)
    assert out.reward_score is None and "not a finite number" in out.extra_fields["reward_error"]
    fine = AgentLoopOutput(prompt_ids=[1], response_ids=[5], response_mask=[1], num_turns=2)
    worker.score(fine, {"reward": {"score": 0.5}})
    assert fine.reward_score == 0.5 and "reward_error" not in fine.extra_fields
