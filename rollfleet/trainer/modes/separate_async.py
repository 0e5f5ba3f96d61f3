"""``separate_async``: rollout and training run at the same time on separate resources.

A rollouter keeps GRPO groups generating into a bounded buffer while the learner trains; every
``parameter_sync_step`` steps the weights sync with abort -> resume (in-flight requests continue
on the new weights through ``FullyAsyncLLMServerClient``). Staleness is bounded by
``max_off_policy_steps`` (``drop``, ``wait`` or ``mask``: see :mod:`rollfleet.trainer.staleness`) and
reported per step, dropped groups with their lengths; with ``partial_rollout`` off, interrupted
groups are regenerated instead of resumed.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rollfleet.trainer.base import Trainer
from rollfleet.trainer.registry import register_trainer
from rollfleet.trainer.rollouter import Rollouter
from rollfleet.trainer.staleness import Group, GroupBuffer


@register_trainer("separate_async")
class SeparateAsyncTrainer(Trainer):
    colocated_by_default: ClassVar[bool] = False  # the learner trains while the fleet generates
    rollouter: Rollouter
    buffer: GroupBuffer

    def _start_rollouter(self) -> None:
        t = self.train
        # TrainConfig's validator fills both in (2 x train_batch_size) when they are not given.
        assert t.max_queue_groups is not None and t.max_inflight_groups is not None
        self.buffer = GroupBuffer(
            capacity=t.max_queue_groups,
            max_off_policy_steps=t.max_off_policy_steps,
            strategy=t.max_off_policy_strategy,
            groups_per_version=t.train_batch_size * t.parameter_sync_step,
            version=lambda: self.version,
            trained_in_version=t.train_batch_size * (self.step % t.parameter_sync_step),
        )
        self.rollouter = Rollouter(
            self.agent_manager,
            self.stream,
            self.buffer,
            n=self.config.rollout.n,
            max_inflight_groups=t.max_inflight_groups,
            partial_rollout=t.partial_rollout,
            version=lambda: self.version,
            reissue=self._reissue,
        )
        self._reissue = []
        self.rollouter.start()

    async def on_train_begin(self) -> None:
        self._start_rollouter()
        self.fleet_resumed()

    async def sample(self) -> tuple[list[Group], dict[str, Any]]:
        groups, dropped = await self.buffer.take(self.train.train_batch_size)
        lengths = [n for g in dropped for n in g.response_lengths()]
        return groups, {
            "staleness/dropped": len(dropped),
            "staleness/dropped_samples": len(lengths),
            "staleness/dropped_response_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "rollout/queue": len(self.buffer),
            "rollout/inflight_groups": len(self.rollouter.inflight),
            **self.run_totals(),
        }

    def session_totals(self) -> dict[str, Any]:
        if not hasattr(self, "rollouter"):  # a checkpoint before the rollouter started: nothing counted yet
            return {}
        return {
            "staleness/dropped_total": self.buffer.dropped,
            "staleness/over_bound_total": self.buffer.over_bound,
            "rollout/regenerated": self.rollouter.regenerated,
            "rollout/errors": self.rollouter.errors,  # groups that raised (their siblings cancelled); prompts re-issued
            "rollout/waits": self.buffer.waits,
        }

    async def on_sync_end(self) -> None:
        await self.buffer.version_changed()

    def inflight_task_indices(self) -> list[int]:
        queued = [g.task_index for g in list(self.buffer._queue)] if hasattr(self, "buffer") else []
        running = self.rollouter.inflight_task_indices() if hasattr(self, "rollouter") else []
        return sorted(set(queued) | set(running) | set(super().inflight_task_indices()))

    async def on_train_end(self) -> None:
        if hasattr(self, "rollouter"):
            await self.rollouter.stop()
        if self._fleet_active_since is not None:
            self.fleet_paused()
