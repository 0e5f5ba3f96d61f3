"""``colocate_async``: rollout and training share the same resources and take turns.

Rollout runs between learner steps. At sampling time the trainer takes the finished groups, the
fleet is paused (in-flight requests come back ``aborted`` with their partial tokens and wait
client-side) and put to sleep where the engine can free memory, the learner trains, the weights
sync, and generation resumes: interrupted requests continue on the new weights. Unlike ``sync``,
the long tail of one batch keeps generating into the next step instead of idling the learner;
``num_warmup_batches`` batches are kept in flight ahead of the learner.
"""

from __future__ import annotations

import functools
import logging
from typing import ClassVar

from rollfleet.trainer.modes.separate_async import SeparateAsyncTrainer
from rollfleet.trainer.modes.turns import FleetTurns
from rollfleet.trainer.registry import register_trainer

logger = logging.getLogger(__name__)


@register_trainer("colocate_async")
class ColocateAsyncTrainer(SeparateAsyncTrainer):
    colocated_by_default: ClassVar[bool] = True  # rollout and training take turns on the same devices

    @functools.cached_property
    def _turns(self) -> FleetTurns:
        """The fleet hands the shared devices to the learner and gets them back each step."""
        return FleetTurns()

    async def on_train_begin(self) -> None:
        t = self.train
        if "max_inflight_groups" not in t.model_fields_set:
            t.max_inflight_groups = t.train_batch_size * (1 + t.num_warmup_batches)
        self._start_rollouter()
        self.fleet_resumed()

    async def on_sample_end(self) -> None:
        assert self.manager is not None
        self.fleet_paused()
        await self._turns.hand_to_learner(self.manager)

    async def on_sync_begin(self) -> None:
        assert self.manager is not None
        await self._turns.wake(self.manager)

    async def on_step_end(self) -> None:
        assert self.manager is not None
        await self._turns.hand_back(self.manager)
        self.fleet_resumed()

    async def on_train_end(self) -> None:
        """A step that failed between sleep and resume must not leave the fleet asleep (as ``sync``)."""
        await super().on_train_end()
        if self.manager is not None:
            try:
                await self._turns.hand_back(self.manager)
            except Exception:
                logger.exception("waking the fleet after training failed")
