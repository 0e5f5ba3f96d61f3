"""``FullyAsyncAgentLoopManager``: sample-at-a-time rollout for fully-async / streaming training.

Instead of a batch barrier it sends single samples to the least busy worker and streams GRPO
groups out as soon as all ``n`` samples of a group have finished, so a trainer can start on the
first groups while long-tailed trajectories are still running. Workers build
``FullyAsyncLLMServerClient`` by default: a weight update in the middle of a turn is resumed on
the new weights (the trajectory records both versions in ``min/max_global_steps``).

Worker choice is local bookkeeping (the manager counts what it sent each worker), not a round trip
to ask workers for their load: least in flight wins, ties go round-robin (verl's ties always went
to the first worker).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Mapping, Optional

from rollfleet.agent_loop.base import AgentLoopOutput
from rollfleet.agent_loop.batch import RolloutBatch
from rollfleet.agent_loop.manager import AgentLoopManager, Batch
from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.utils.aio import auto_await
from rollfleet.utils.ids import unique_hex


class FullyAsyncAgentLoopManager(AgentLoopManager):
    default_client_cls = FullyAsyncLLMServerClient

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inflight = [0] * len(self.workers)
        self._rr = 0

    def _select_best_worker(self) -> int:
        """Least in-flight samples; among equals, the first at or after the round-robin cursor."""
        n = len(self.workers)
        if n == 0:
            raise RuntimeError("no agent-loop workers (the manager was shut down)")
        low = min(self.inflight)
        for k in range(n):
            w = (self._rr + k) % n
            if self.inflight[w] == low:
                self._rr = (w + 1) % n
                return w
        raise AssertionError("unreachable")

    async def generate_sequences_single(self, sample: Mapping[str, Any]) -> AgentLoopOutput:
        """Run one sample (no repetition by ``n``) on the least busy worker."""
        sample = dict(sample)
        if "uid" not in sample:
            sample["uid"] = unique_hex()
        w = self._select_best_worker()
        self.inflight[w] += 1
        try:
            return await self.workers[w].call("run_sample", sample)
        finally:
            self.inflight[w] -= 1

    async def stream_groups(
        self, batch: Batch, *, n: Optional[int] = None, max_concurrent_samples: Optional[int] = None
    ) -> AsyncIterator[RolloutBatch]:
        """Yield one :class:`RolloutBatch` per GRPO group, in order of completion.

        At most ``max_concurrent_samples`` samples run at once (default: workers x
        ``agent.max_concurrent_trajectories``). Closing the iterator cancels what is still
        running; to leave a loop early, iterate inside ``contextlib.aclosing(...)`` so that
        happens at once rather than when the generator is garbage-collected.
        """
        samples = self.expand(batch, n)
        limit = max_concurrent_samples or len(self.workers) * self.config.agent.max_concurrent_trajectories
        sem = asyncio.Semaphore(limit)
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(samples):
            groups.setdefault(s["uid"], []).append(i)
        done: dict[int, AgentLoopOutput] = {}

        async def one(i: int) -> int:
            async with sem:
                done[i] = await self.generate_sequences_single(samples[i])
            return i

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(samples))]
        try:
            for finished in asyncio.as_completed(tasks):
                i = await finished
                members = groups[samples[i]["uid"]]
                if all(m in done for m in members):
                    yield self.collate([done.pop(m) for m in members], [samples[m]["uid"] for m in members])
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @auto_await
    async def get_replicas(self) -> list[dict[str, Any]]:
        """The fleet's replicas, from the server manager."""
        if self.server_manager is None:
            raise RuntimeError("get_replicas needs the server manager (this manager was built on a bare client)")
        return await self.server_manager.get_replicas()


__all__ = ["FullyAsyncAgentLoopManager"]
