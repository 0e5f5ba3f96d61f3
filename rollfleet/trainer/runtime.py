"""Where a trainer's parts run and which clock measures them: the seam between a trainer mode and
the machinery under it.

A trainer needs three parts (a fleet that hands out clients and takes weights, a learner, an
agent-loop manager) and a clock for its step times and timeline. :class:`RayRuntime`, the default,
builds them as a training run does: the fleet on Ray, the learner in a Ray actor where the fleet
places it, the agent-loop workers as Ray actors, wall time. Another runtime can build the same
parts elsewhere while the trainer's own code (the modes, the rollouter, the staleness buffer, the
weight-sync path) runs unchanged: :class:`rollfleet.plan.VirtualRuntime` runs them in one process
on a virtual clock, to plan a cluster on a laptop.
"""

from __future__ import annotations

import abc
import time
from typing import Any

from rollfleet.config import RollfleetConfig


class TrainerRuntime(abc.ABC):
    """Builds a trainer's fleet, learner and agent-loop manager, and tells the time."""

    def clock(self) -> float:
        """Seconds on this runtime's clock (epoch seconds here: the timeline is wall time)."""
        return time.time()

    @abc.abstractmethod
    async def create_fleet(self, config: RollfleetConfig) -> Any:
        """A started fleet with ``LLMServerManager``'s surface (``get_client``, ``update_weights``,
        ``pause`` / ``resume`` / ``sleep`` / ``wake_up``, ``learner_placement``, ``shutdown``)."""

    @abc.abstractmethod
    async def create_learner(self, factory: Any, fleet: Any) -> Any:
        """A learner built by ``factory`` (a picklable zero-argument callable, see
        ``Trainer.build_learner``), with ``RemoteLearner``'s awaitable methods."""

    @abc.abstractmethod
    async def create_agent_manager(self, config: RollfleetConfig, llm_client: Any, fleet: Any) -> Any:
        """Agent-loop workers routing through ``llm_client`` (``expand``, ``generate_sequences_single``,
        ``collate``, ``shutdown``)."""


class RayRuntime(TrainerRuntime):
    """A training run: everything on Ray, wall time."""

    async def create_fleet(self, config: RollfleetConfig) -> Any:
        from rollfleet.manager import LLMServerManager

        return await LLMServerManager.create(config)

    async def create_learner(self, factory: Any, fleet: Any) -> Any:
        from rollfleet.trainer.remote_learner import RemoteLearner

        return await RemoteLearner.create(factory, await fleet.learner_placement())

    async def create_agent_manager(self, config: RollfleetConfig, llm_client: Any, fleet: Any) -> Any:
        from rollfleet.agent_loop import FullyAsyncAgentLoopManager

        # As in verl: the workers get the trainer's client (each actor rebuilds it on the same
        # fleet with the same class and settings); the manager closes this one on shutdown.
        return await FullyAsyncAgentLoopManager.create(config, llm_client=llm_client, server_manager=fleet)


__all__ = ["TrainerRuntime", "RayRuntime"]
