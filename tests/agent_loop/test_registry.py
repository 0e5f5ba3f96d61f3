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
