"""Agent-loop managers without Ray: worker choice, streaming groups as they finish, a failed chunk ending the rest."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import pytest
import torch  # noqa: F401  (imported up front: its first import would dominate the timings below)

from rollfleet.agent_loop import AgentLoopOutput, FullyAsyncAgentLoopManager
from rollfleet.agent_loop.manager import WorkerRef
from rollfleet.config import RollfleetConfig

pytestmark = pytest.mark.unit


class FakeWorker:
    """Finishes each sample after its ``delay``."""

    def __init__(self):
        self.samples = []
        self.cancelled = 0

    async def run_sample(self, sample):
        self.samples.append(sample)
        try:
            await asyncio.sleep(sample["delay"])
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return AgentLoopOutput(prompt_ids=[1, 2], response_ids=[3], response_mask=[1], num_turns=2)


def manager(num_workers=3, n=2):
    config = RollfleetConfig.model_validate({"rollout": {"n": n, "prompt_length": 4, "response_length": 4}})
    workers = [WorkerRef(FakeWorker(), remote=False) for _ in range(num_workers)]
    return FullyAsyncAgentLoopManager(config, workers, pad_token_id=0)


def test_least_busy_worker_ties_round_robin():
    m = manager()
    picks = []
    for _ in range(6):
        picks.append(m._select_best_worker())
    assert picks == [0, 1, 2, 0, 1, 2]  # all idle: round-robin, not always the first
    m.inflight = [2, 1, 1]
    assert [m._select_best_worker() for _ in range(2)] == [1, 2]
    m.inflight = [0, 3, 3]
    assert m._select_best_worker() == 0


async def test_single_samples_go_to_the_least_busy_worker():
    m = manager()
    slow = [asyncio.ensure_future(m.generate_sequences_single({"prompt_ids": [1], "delay": 0.2})) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert sorted(m.inflight) == [0, 1, 1]
    out = await m.generate_sequences_single({"prompt_ids": [1], "delay": 0.0})
    assert out.num_turns == 2
    idle = [i for i, w in enumerate(m.workers) if len(w.target.samples) == 1 and w.target.samples[0]["delay"] == 0.0]
    assert len(idle) == 1
    await asyncio.gather(*slow)
    assert m.inflight == [0, 0, 0]


async def test_groups_stream_out_as_they_complete():
    m = manager(n=2)
    prompts = [{"prompt_ids": [1], "delay": 0.4, "uid": "slow"}, {"prompt_ids": [2], "delay": 0.01, "uid": "fast"}]
    start = time.perf_counter()
    seen = []
    async for group in m.stream_groups(prompts):
        seen.append((group.uid, time.perf_counter() - start))
    assert [uid for uid, _ in seen] == [["fast", "fast"], ["slow", "slow"]]
    assert seen[0][1] < 0.3  # the fast group did not wait for the slow one
    assert len(seen) == 2 and all(len(u) == 2 for u, _ in seen)


async def test_leaving_the_stream_cancels_the_rest():
    m = manager(n=1)
    prompts = [{"prompt_ids": [1], "delay": 0.01}] + [{"prompt_ids": [1], "delay": 5.0}] * 3
    async with aclosing(m.stream_groups(prompts)) as groups:
        async for _group in groups:
            break
    assert sum(w.target.cancelled for w in m.workers) == 3
    assert m.inflight == [0, 0, 0]


async def test_with_full_determinism_each_prompt_the_rollouter_expands_is_its_own_group():
    """The async trainers expand one prompt at a time: named after its place in that one-prompt
    list, every group was ``group-0`` (GRPO normalised rewards across prompts, one group of 6 for
    3 prompts) and the groups in flight shared request ids ``det-0-0``, ``det-0-1``."""
    from rollfleet.trainer.rollouter import Rollouter
    from rollfleet.trainer.staleness import GroupBuffer
    from rollfleet.trainer.tasks import make_task

    config = RollfleetConfig.model_validate(
        {"rollout": {"n": 2, "prompt_length": 4, "response_length": 4, "full_determinism": True}}
    )
    workers = [WorkerRef(FakeWorker(), remote=False)]
    mgr = FullyAsyncAgentLoopManager(config, workers, pad_token_id=0)
    tasks = make_task("synthetic", 0, prompt_tokens=4)
    seen = []
    original = mgr.expand

    def expand(batch, n=None):
        samples = original([dict(s, delay=0.01) for s in batch], n)
        seen.append(samples)
        return samples

    mgr.expand = expand
    buffer = GroupBuffer(capacity=8, max_off_policy_steps=1, strategy="mask", groups_per_version=3, version=lambda: 0)
    rollouter = Rollouter(mgr, tasks, buffer, n=2, max_inflight_groups=3, partial_rollout=True, version=lambda: 0)
    rollouter.start()
    try:
        groups, _ = await asyncio.wait_for(buffer.take(3), 10)
    finally:
        await rollouter.stop()
    assert len({g.uid for g in groups}) == 3
    assert {g.uid for g in groups} == {f"group-{g.task_index}" for g in groups}
    request_ids = [s["request_id"] for samples in seen for s in samples]
    assert len(set(request_ids)) == len(request_ids)
    # the same names in every run: a second expansion of a task gives the same ones
    again = original([tasks.sample_at(groups[0].task_index)], 2)
    assert [s["request_id"] for s in again] == [f"det-{groups[0].task_index}-{j}" for j in range(2)]


class ChunkWorker(FakeWorker):
    """A worker of the batch API: its chunk fails at once when a sample says so."""

    async def generate_sequences(self, samples):
        if any(s.get("fail") for s in samples):
            raise RuntimeError("a sample's loop failed")
        return [await self.run_sample(s) for s in samples]


async def test_one_workers_chunk_failing_ends_the_other_workers_chunks():
    """``asyncio.gather`` left them running: their samples went on generating on the fleet, unseen."""
    from rollfleet.agent_loop import AgentLoopManager

    config = RollfleetConfig.model_validate({"rollout": {"n": 1, "prompt_length": 4, "response_length": 4}})
    workers = [ChunkWorker(), ChunkWorker()]
    mgr = AgentLoopManager(config, [WorkerRef(w, remote=False) for w in workers], pad_token_id=0)
    batch = [{"prompt_ids": [1], "delay": 30.0}, {"prompt_ids": [2], "delay": 0.0, "fail": True}]
    with pytest.raises(RuntimeError, match="a sample's loop failed"):
        await asyncio.wait_for(mgr.generate_sequences(batch), 5)
    assert workers[0].cancelled == 1
