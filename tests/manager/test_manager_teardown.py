"""The fleet manager's shutdown ends even when its controller never answers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rollfleet.manager import llm_server_manager
from rollfleet.manager.llm_server_manager import LLMServerManager

pytestmark = pytest.mark.unit


async def test_a_wedged_controller_is_killed_after_the_shutdown_bound(monkeypatch):
    """A controller whose loop is stuck never answers ``shutdown``: the manager's shutdown (a
    trainer's close, the end of a run) used to wait on it for good. Past the bound it kills it,
    which takes the replica actors it owns with it, and returns."""
    import ray

    killed: list[object] = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    monkeypatch.setattr(llm_server_manager, "CONTROLLER_SHUTDOWN_TIMEOUT_S", 0.2, raising=False)

    async def never() -> None:
        await asyncio.Event().wait()

    controller = SimpleNamespace(shutdown=SimpleNamespace(remote=never))
    manager = LLMServerManager.__new__(LLMServerManager)
    manager.controller, manager._started_ray = controller, False
    await asyncio.wait_for(manager._teardown(), 5)
    assert killed == [controller] and manager.controller is None
