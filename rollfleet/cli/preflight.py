"""Names a command looks up only once it runs (Ray up, the fleet launched), looked up first.

An agent loop, a task or a tool-call parser is named in the config and resolved by the process
that uses it: a typo there surfaced as a traceback after Ray and the fleet had started (13-16 s
here, minutes on a cluster), where every other bad setting is one line and exit status 2 before
anything starts. Each check raises ``ValueError`` naming the setting.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from rollfleet.config import RollfleetConfig
from rollfleet.errors import UnknownName


def check_engine(config: RollfleetConfig) -> None:
    """A sim replica's KV cache holds one whole sequence (checked by each replica as it starts)."""
    rollout = config.rollout
    if rollout.name == "sim" and rollout.max_model_len is not None:
        rollout.sim.check_holds_a_sequence(rollout.max_model_len)


def check_train(config: RollfleetConfig, task: str) -> None:
    """The engine, the agent loop samples run by default (registered, with what it needs), the task,
    and room for responses after prompts of ``rollout.prompt_length``."""
    from rollfleet.agent_loop.registry import get_agent_loop, load_agent_loop_config
    from rollfleet.trainer.tasks import make_task

    check_engine(config)
    rollout = config.rollout
    if rollout.num_replicas < 1:  # nothing in training grows the fleet: every request would wait, then fail
        raise ValueError(f"rollout.num_replicas must be >= 1 to train, got {rollout.num_replicas}")
    agent = config.agent
    try:
        load_agent_loop_config(agent.agent_loop_config_path)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"agent.agent_loop_config_path: {exc}") from None
    try:
        spec = get_agent_loop(agent.default_agent_loop)
    except UnknownName as exc:
        raise ValueError(f"agent.default_agent_loop: {exc}") from None
    http = agent.http_agent
    if spec.name == "http_agent" and not {"agent", "command"} & set(spec.kwargs):
        if (http.agent is None) == (http.command is None):
            raise ValueError(
                "agent.http_agent: give agent (a callable) or command (a program), one of them: "
                "agent.default_agent_loop is http_agent"
            )
        _check_parser("gateway.tool_call_parser", config.gateway.tool_call_parser)  # its gateway parses calls
        if not _workers_have_their_own_files(config):
            _check_agent(http.agent, http.command)
    if spec.name == "tool_agent":
        _check_parser("agent.multi_turn.format", agent.multi_turn.format)
    try:
        make_task(task)
    except ValueError as exc:
        raise ValueError(f"trainer.task: {exc}") from None


def check_serve(config: RollfleetConfig) -> None:
    """The engine and the gateway's tool-call parser."""
    check_engine(config)
    _check_parser("gateway.tool_call_parser", config.gateway.tool_call_parser)


#: runtime_env keys that give a joined cluster's workers files, packages or programs of their own.
_WORKER_FILES = ("working_dir", "py_modules", "pip", "conda", "uv", "container", "image_uri")


def _workers_have_their_own_files(config: RollfleetConfig) -> bool:
    """Joining a cluster with a runtime_env that ships files or installs packages, the agent is
    looked up where the workers run, not here: a file in ``working_dir`` or a package ``pip``
    installs exists only there."""
    ray = config.ray
    return bool(ray.address) and any(ray.runtime_env.get(key) for key in _WORKER_FILES)


def _check_agent(agent: str | None, command: list[str] | None) -> None:
    """The agent's file or package, or its program, is there (without running any of it: the
    workers import the agent; importing it here too would run its module's code twice, so a
    module path is checked as far as its top-level package)."""
    if agent is not None:
        target, sep, name = agent.rpartition(":")
        if not sep:  # verl's dotted form, pkg.module.fn
            target, _, name = agent.rpartition(".")
        if not target or not name:
            raise ValueError(f"agent.http_agent.agent: {agent!r} is not 'path/to/file.py:fn' or 'pkg.module:fn'")
        if target.endswith(".py"):
            if not Path(target).is_file():
                raise ValueError(f"agent.http_agent.agent: no file {target} (from {Path.cwd()})")
        else:
            top = target.split(".")[0]  # finding a submodule imports its parents: their code runs
            try:
                found = importlib.util.find_spec(top)
            except (ImportError, ValueError):
                found = None
            if found is None:
                raise ValueError(f"agent.http_agent.agent: no package {top!r} to import {target!r} from")
    if command:
        program = command[0]
        if program != "{python}" and shutil.which(program) is None and not Path(program).is_file():
            raise ValueError(f"agent.http_agent.command: no program {program!r} (not on PATH, not a file)")


def _check_parser(setting: str, name: str) -> None:
    from rollfleet.tool_parser import get_tool_parser

    try:
        get_tool_parser(name)
    except UnknownName as exc:
        raise ValueError(f"{setting}: {exc}") from None


__all__ = ["check_engine", "check_train", "check_serve"]
