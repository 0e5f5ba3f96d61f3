"""``colocate_async``: rollout and training share the same resources and take turns.

Rollout runs between learner steps. At sampling time the trainer takes the finished groups, the
fleet is paused (in-flight requests come back ``aborted`` with their partial tokens and wait
client-side) and put to sleep where the engine can free memory, the learner trains, the weights
sync, and generation resumes: interrupted requests continue on the new weights. Unlike ``sync``,
the long tail of one batch keeps generating into the next step instead of idling the learner;
``num_warmup_batches`` batches are kept in flight ahead of the learner.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from rollfleet.errors import NotSupported
from rollfleet.trainer.modes.separate_async import SeparateAsyncTrainer
from rollfleet.trainer.registry import register_trainer

logger = logging.getLogger(__name__)


@register_trainer("colocate_async")
class ColocateAsyncTrainer(SeparateAsyncTrainer):
    colocated_by_default: ClassVar[bool] = True  # rollout and training take turns on the same devices
    _sleep_supported = True
    _asleep = False

    async def on_train_begin(self) -> None:
        t = self.train
        if "max_inflight_groups" not in t.model_fields_set:
            t.max_inflight_groups = t.train_batch_size * (1 + t.num_warmup_batches)
        self._start_rollouter()
        self.fleet_resumed()

    async def on_sample_end(self) -> None:
        assert self.manager is not None
        self.fleet_paused()
        await self.manager.pause()
        if self._sleep_supported:
            try:
                await self.manager.sleep()
                self._asleep = True
            except NotSupported as exc:
                self._sleep_supported = False
                logger.info("fleet cannot sleep (%s): training next to a paused, awake fleet", exc)

    async def _wake(self) -> None:
        if self._asleep:
            assert self.manager is not None
            await self.manager.wake_up()
            self._asleep = False

    async def on_sync_begin(self) -> None:
        await self._wake()  # an engine loads new weights awake (vLLM's sleep frees them)

    async def on_step_end(self) -> None:
        assert self.manager is not None and self.tracker is not None
        await self._wake()  # no sync this step (parameter_sync_step > 1)
        await self.manager.resume()
        self.fleet_resumed()
