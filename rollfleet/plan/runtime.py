"""A trainer's parts in one process on a virtual clock: the real trainer modes, planned.

:class:`VirtualRuntime` gives a :class:`~rollfleet.trainer.base.Trainer` a
:class:`~rollfleet.plan.fleet.VirtualFleet` (sim replicas and the real client, no Ray), a
:class:`VirtualLearner` (the simulated learner's cost, slept on the loop's clock) and in-process
agent-loop workers, and times everything on the loop's clock. Run under
:func:`rollfleet.utils.virtual_time.run`, a whole training run (generation with continuous
batching and prefix caching, routing, weight sync in its mode, staleness, the learner) takes
simulated seconds only: the step times, idle fractions and staleness it reports are the same on
any host and under any load.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rollfleet.agent_loop import FullyAsyncAgentLoopManager
from rollfleet.config import RollfleetConfig
from rollfleet.models.lazy_tokenizer import LazyTokenizer
from rollfleet.plan.fleet import VirtualFleet
from rollfleet.trainer.remote_learner import LearnerSpec
from rollfleet.trainer.runtime import TrainerRuntime
from rollfleet.trainer.sim_learner import SimulatedLearner


class VirtualLearner:
    """``RemoteLearner``'s surface over a :class:`SimulatedLearner` whose steps take simulated
    time: an update sleeps on the loop's clock, so generation goes on meanwhile where the mode
    lets it (as it does beside a learner actor)."""

    def __init__(self, learner: SimulatedLearner) -> None:
        self.learner = learner
        self.busy_s = 0.0

    async def update(self, batch: Any) -> dict[str, float]:
        seconds, metrics = self.learner.step(batch)
        self.busy_s += seconds
        await asyncio.sleep(seconds)
        return metrics

    async def state_dict_for_inference(self) -> Any:
        return self.learner.state_dict_for_inference()

    async def save(self, root: str | Path, state: dict[str, Any]) -> Path:
        return self.learner.save(root, state)

    async def load(self, root: str | Path) -> dict[str, Any]:
        return self.learner.load(root)

    def kill(self) -> None:
        """Nothing to stop: the learner lives in this process."""


class VirtualRuntime(TrainerRuntime):
    """Fleet, learner and workers in this process; the running loop's clock (virtual under
    :func:`rollfleet.utils.virtual_time.run`). Keeps the fleet and learner it built for reports."""

    def __init__(self) -> None:
        self.fleet: VirtualFleet | None = None
        self.learner: VirtualLearner | None = None

    def clock(self) -> float:
        return asyncio.get_running_loop().time()

    async def create_fleet(self, config: RollfleetConfig) -> VirtualFleet:
        self.fleet = await VirtualFleet.create(config)
        return self.fleet

    async def create_learner(self, factory: Any, fleet: Any) -> VirtualLearner:
        if not (isinstance(factory, LearnerSpec) and factory.kind == "sim"):
            raise ValueError(
                "a virtual run trains the simulated learner only: set trainer.sim_learner.enabled: true "
                f"(got a {getattr(factory, 'kind', type(factory).__name__)!r} learner)"
            )
        self.learner = VirtualLearner(SimulatedLearner(factory.config))
        return self.learner

    async def create_agent_manager(self, config: RollfleetConfig, llm_client: Any, fleet: Any) -> Any:
        # No server manager: in-process workers that share the trainer's client. A plan's agent
        # loops read only the tokenizer's special ids: transformers loads if anything else is read.
        tokenizer = LazyTokenizer(config.rollout.model)
        return await FullyAsyncAgentLoopManager.create(config, llm_client=llm_client, tokenizer=tokenizer)


__all__ = ["VirtualRuntime", "VirtualLearner"]
