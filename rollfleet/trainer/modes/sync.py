"""``sync``: generate a batch, train, sync weights; nothing overlaps.

On-policy (staleness 0) and simple, and the baseline the async modes are measured against: the
learner idles while the slowest trajectory of the batch finishes, and the fleet idles while the
learner trains.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollfleet.client import LLMServerClient
from rollfleet.trainer.base import Trainer
from rollfleet.trainer.registry import register_trainer
from rollfleet.trainer.staleness import Group


@register_trainer("sync")
class SyncTrainer(Trainer):
    client_cls = LLMServerClient

    async def sample(self) -> tuple[list[Group], dict[str, Any]]:
        assert self.agent_manager is not None
        n = self.config.rollout.n
        prompts = [self.stream.sample_at(self._reissue.pop(0)) if self._reissue else self.stream.next()
                   for _ in range(self.train.train_batch_size)]
        samples = self.agent_manager.expand(prompts, n)
        with self.tracker.span("fleet", "generating", step=self.step):
            outputs = await asyncio.gather(*(self.agent_manager.generate_sequences_single(s) for s in samples))
        groups: dict[str, Group] = {}
        for s, o in zip(samples, outputs):
            g = groups.setdefault(s["uid"], Group(uid=s["uid"], outputs=[], started_version=self.version,
                                                  min_version=self.version, max_version=self.version,
                                                  task_index=int(s.get("task_index", -1))))
            g.outputs.append(o)
            lo = o.extra_fields.get("min_global_steps")
            if lo is not None:
                g.min_version = min(g.min_version, lo)
        return list(groups.values()), {"staleness/dropped": 0}
