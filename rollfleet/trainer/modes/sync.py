"""``sync``: generate a batch, train, sync weights; nothing overlaps.

On-policy (staleness 0) and simple, and the baseline the async modes are measured against: the
learner idles while the slowest trajectory of the batch finishes, and the fleet idles while the
learner trains. So the fleet is paused and, where the engine can free memory, put to sleep while
the learner trains on the same devices (the learner is colocated by default); it wakes before the
weights load (an engine loads weights awake) and resumes at the end of the step.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, ClassVar

from rollfleet.client import LLMServerClient
from rollfleet.trainer.base import Trainer
from rollfleet.trainer.modes.turns import FleetTurns
from rollfleet.trainer.registry import register_trainer
from rollfleet.trainer.staleness import Group
from rollfleet.utils.aio import gather_or_cancel

logger = logging.getLogger(__name__)


@register_trainer("sync")
class SyncTrainer(Trainer):
    client_cls = LLMServerClient
    colocated_by_default: ClassVar[bool] = True

    @functools.cached_property
    def _turns(self) -> FleetTurns:
        """The fleet hands the shared devices to the learner and gets them back each step."""
        return FleetTurns()

    async def sample(self) -> tuple[list[Group], dict[str, Any]]:
        assert self.agent_manager is not None and self.tracker is not None
        n = self.config.rollout.n
        prompts = [
            self.stream.sample_at(self._reissue.pop(0)) if self._reissue else self.stream.next()
            for _ in range(self.train.train_batch_size)
        ]
        samples = self.agent_manager.expand(prompts, n)
        with self.tracker.span("fleet", "generating", step=self.step):
            outputs = await gather_or_cancel(self.agent_manager.generate_sequences_single(s) for s in samples)
        groups: dict[str, Group] = {}
        for s, o in zip(samples, outputs):
            g = groups.setdefault(
                s["uid"],
                Group(
                    uid=s["uid"],
                    outputs=[],
                    started_version=self.version,
                    min_version=self.version,
                    max_version=self.version,
                    task_index=int(s.get("task_index", -1)),
                ),
            )
            g.outputs.append(o)
            lo = o.extra_fields.get("min_global_steps")
            if lo is not None:
                g.min_version = min(g.min_version, lo)
        return list(groups.values()), {"staleness/dropped": 0}

    async def on_sample_end(self) -> None:
        assert self.manager is not None
        await self._turns.hand_to_learner(self.manager)

    async def on_sync_begin(self) -> None:
        assert self.manager is not None
        await self._turns.wake(self.manager)

    async def on_step_end(self) -> None:
        assert self.manager is not None
        await self._turns.hand_back(self.manager)

    async def on_train_end(self) -> None:
        """A step that failed between sleep and resume must not leave the fleet asleep."""
        try:
            await self.on_step_end()
        except Exception:
            logger.exception("waking the fleet after training failed")
