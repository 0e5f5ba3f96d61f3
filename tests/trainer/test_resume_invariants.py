"""What a checkpoint and a resumed run must keep: every prompt taken from the stream is either
trained or re-issued, and the ``wait`` strategy's staleness bound holds after a resume and while
new weights stage. Driven by hand (fake agents and learner, real buffer, rollouter and trainer
hooks), in real time but with short waits."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from trainer_support import InstantAgents

from rollfleet.trainer.modes.separate_async import SeparateAsyncTrainer
from rollfleet.trainer.rollouter import Rollouter
from rollfleet.trainer.staleness import GroupBuffer
from rollfleet.trainer.tasks import make_task

pytestmark = pytest.mark.unit


class Agents:
    """Prompt ``finish`` (a task index) finishes at once; every other one generates until cancelled."""

    def __init__(self, finish: int = -1) -> None:
        self.finish = finish

    def expand(self, batch: list[dict], n: int) -> list[dict]:
        return [{**batch[0], "uid": f"u{batch[0]['task_index']}", "k": k} for k in range(n)]

    async def generate_sequences_single(self, sample: dict) -> Any:
        if sample["task_index"] != self.finish:
            await asyncio.sleep(3600)
        return SimpleNamespace(
            extra_fields={"min_global_steps": 0, "max_global_steps": 0},
            metrics=SimpleNamespace(num_resumes=0),
            response_mask=[1],
            response_ids=[1],
        )


class Learner:
    def __init__(self) -> None:
        self.saved: list[dict] = []

    async def save(self, root: Any, state: dict) -> Any:
        self.saved.append(state)
        return root

    async def state_dict_for_inference(self) -> object:
        return object()


def _trainer(buffer: Any, rollouter: Any, stream: Any) -> SeparateAsyncTrainer:
    """The async trainer's hooks and checkpoint state without a fleet (no ``init``)."""
    t = SeparateAsyncTrainer.__new__(SeparateAsyncTrainer)
    t.buffer, t.rollouter, t.stream = buffer, rollouter, stream
    t.learner, t.run_dir, t.step, t.version, t.syncs = Learner(), Path("run"), 1, 0, 0
    t._reissue, t._fleet_active_since = [], None
    t.train = SimpleNamespace(partial_rollout=True)
    t.tracker = SimpleNamespace(span=lambda *a, **k: contextlib.nullcontext())
    return t


async def test_the_final_checkpoint_keeps_the_prompts_the_stop_cancelled():
    """fit() stops the rollouter (on_train_end) before its final checkpoint: the groups it cancels,
    started or not yet run, are re-issued after a resume, not lost past the stream position."""
    buffer = GroupBuffer(capacity=8, max_off_policy_steps=2, strategy="drop", groups_per_version=2, version=lambda: 0)
    stream = make_task("count", 0)
    rollouter = Rollouter(
        Agents(finish=0), stream, buffer, n=2, max_inflight_groups=4, partial_rollout=True, version=lambda: 0
    )
    t = _trainer(buffer, rollouter, stream)
    rollouter.start()
    taken, _ = await asyncio.wait_for(buffer.take(1), 5)
    assert [g.task_index for g in taken] == [0]
    await asyncio.sleep(0.05)  # prompts 1..4 generate
    await t.on_train_end()
    await t.save_checkpoint()
    saved = t.learner.saved[-1]
    assert saved["data_position"] == stream.position == 5
    assert saved["inflight_task_indices"] == [1, 2, 3, 4]  # every prompt taken but not trained


async def test_a_group_cancelled_before_it_ran_is_kept_too():
    buffer = GroupBuffer(capacity=8, max_off_policy_steps=2, strategy="drop", groups_per_version=2, version=lambda: 0)
    stream = make_task("count", 0)
    rollouter = Rollouter(Agents(), stream, buffer, n=1, max_inflight_groups=3, partial_rollout=True, version=lambda: 0)
    rollouter.start()
    for _ in range(8):  # the rollouter's loop takes prompts; stop before their tasks take a step
        await asyncio.sleep(0)
        if stream.position:
            break
    await rollouter.stop()
    assert stream.position > 0
    assert rollouter.inflight_task_indices() == list(range(stream.position))


async def test_a_checkpoint_keeps_reissued_prompts_not_yet_started():
    """After a resume, prompts queued for re-issue wait for room; a checkpoint taken meanwhile
    (save_freq) must still list them."""
    buffer = GroupBuffer(capacity=8, max_off_policy_steps=2, strategy="drop", groups_per_version=2, version=lambda: 0)
    stream = make_task("count", 0, position=100)
    reissue = [90, 91, 92, 93, 94, 95]
    rollouter = Rollouter(
        Agents(), stream, buffer, n=1, max_inflight_groups=2, partial_rollout=True, version=lambda: 0, reissue=reissue
    )
    t = _trainer(buffer, rollouter, stream)
    rollouter.start()
    await asyncio.sleep(0.05)
    assert sorted(rollouter.inflight) == [90, 91] and rollouter._reissue == [92, 93, 94, 95]
    await t.save_checkpoint()
    assert t.learner.saved[-1]["inflight_task_indices"] == reissue
    await rollouter.stop()
    assert stream.position == 100  # nothing new was taken while re-issued prompts waited


async def test_wait_bound_holds_in_a_resumed_run():
    """A resumed run's buffer starts at the checkpoint's version, not 0: with b = 0 it admits one
    version's worth of groups, as a fresh run's does (it admitted (6 + 1) x 4 at version 6)."""
    for version in (0, 6):
        buf = GroupBuffer(
            capacity=99, max_off_policy_steps=0, strategy="wait", groups_per_version=4, version=lambda v=version: v
        )
        started = 0
        while buf.may_start():
            await buf.wait_to_start()
            started += 1
        assert started == 4, version


@pytest.mark.parametrize("resumed_at", [0, 3, 4])
async def test_wait_bound_holds_when_a_run_resumes_between_two_syncs(resumed_at):
    """Weights sync every 2 steps of 2 groups, bound 0. A run resumed at step 3 syncs after one
    step, not two: its buffer used to admit two steps of groups at the resumed version, and the
    second step trained them one version stale (6 of 12 groups over the bound)."""
    t = SeparateAsyncTrainer.__new__(SeparateAsyncTrainer)
    t.train = SimpleNamespace(
        max_queue_groups=99,
        max_inflight_groups=99,
        max_off_policy_steps=0,
        max_off_policy_strategy="wait",
        train_batch_size=2,
        parameter_sync_step=2,
        partial_rollout=True,
    )
    t.config = SimpleNamespace(rollout=SimpleNamespace(n=2))
    t.agent_manager, t.stream, t._reissue = InstantAgents(), make_task("count", 0), []
    t.step, t.version = resumed_at, (resumed_at // 2 + 1 if resumed_at else 0)  # resumed: saved version + 1
    t._start_rollouter()
    staleness = []
    for _ in range(6):  # as fit() does: train a step, sync every parameter_sync_step steps
        t.step += 1
        await asyncio.sleep(0.01)
        groups, _ = await asyncio.wait_for(t.buffer.take(2), 5)
        staleness += [t.version - g.min_version for g in groups]
        if t.step % 2 == 0:
            t.version += 1
            await t.buffer.version_changed()
    await t.rollouter.stop()
    assert staleness == [0] * 12 and t.buffer.over_bound == 0


async def test_the_version_moves_only_once_the_new_weights_are_committed():
    """While new weights stage the fleet still generates on the old ones: a group started then
    belongs to the old version, so ``wait`` must not admit the next version's groups yet."""
    committed: list[int] = []
    seen: list[tuple[int, bool]] = []

    class Fleet:
        async def update_weights(self, weights: Any, version: int, mode: Any = None) -> dict:
            seen.append((t.version, t.buffer.may_start()))
            await asyncio.sleep(0.01)  # staging: the replicas keep serving the old version
            committed.append(version)
            return {"mode": "keep"}

    t = _trainer(None, rollouter=None, stream=None)
    t.buffer = GroupBuffer(
        capacity=99, max_off_policy_steps=0, strategy="wait", groups_per_version=2, version=lambda: t.version
    )
    t.manager = Fleet()
    for _ in range(2):
        await t.buffer.wait_to_start()
    assert not t.buffer.may_start()
    await t.sync_weights()
    assert seen == [(0, False)]  # still version 0, and no room, while the weights staged
    assert committed == [1] and t.version == 1 and t.buffer.may_start()


class _AdvantageLearner:
    """Computes the batch's GRPO advantages as the learner does, and keeps them."""

    def __init__(self) -> None:
        self.advantages: list[float] = []
        self.masked_rows: list[float] = []

    async def update(self, batch: Any) -> dict[str, float]:
        from rollfleet.trainer.algos import compute_advantages

        adv = compute_advantages("grpo", batch.scores, batch.uid, batch.response_mask)
        self.advantages = [float(row.abs().max() * (1 if row.sum() >= 0 else -1)) for row in adv]
        self.masked_rows = batch.response_mask.sum(1).tolist()
        return {}


def _trainer_over(learner: Any) -> Any:
    from rollfleet.agent_loop.batch import collate

    trainer = object.__new__(SeparateAsyncTrainer)
    trainer.agent_manager = SimpleNamespace(
        collate=lambda o, u: collate(o, u, prompt_length=4, response_length=4, pad_token_id=0)
    )
    trainer.tracker = SimpleNamespace(span=lambda *a, **k: contextlib.nullcontext())
    trainer.learner = learner
    trainer.train = SimpleNamespace(max_off_policy_strategy="drop", max_off_policy_steps=1)
    trainer.version, trainer.step = 0, 1
    return trainer


def _output(score: Any, exhausted: bool = False, reward_error: Any = None) -> Any:
    from rollfleet.agent_loop.base import AgentLoopOutput

    extra = {"resume_exhausted": exhausted, "min_global_steps": 0, "max_global_steps": 0}
    if reward_error:
        extra["reward_error"] = reward_error
    return AgentLoopOutput([1, 2, 3], [5, 6, 7], [1, 1, 1], reward_score=score, extra_fields=extra)


async def test_a_step_where_every_reward_failed_stops_the_run_and_one_failure_does_not():
    """The worker leaves a sample whose reward function raised unscored; when every sample of a
    step is so, the reward function is broken, and training on nothing would hide it."""
    from rollfleet.trainer.staleness import Group

    trainer = _trainer_over(_AdvantageLearner())
    broken = [Group("g", [_output(None, reward_error="ZeroDivisionError('x')")] * 2, 0, 0, 0)]
    with pytest.raises(RuntimeError, match="every sample's reward failed at step 1.*ZeroDivisionError"):
        await trainer._train_on(broken)
    one = [Group("g", [_output(1.0), _output(None, reward_error="ZeroDivisionError('x')")], 0, 0, 0)]
    metrics, trained = await trainer._train_on(one)
    assert metrics["reward/errors"] == 1.0 and trainer.learner.masked_rows == [3, 0]
    assert trained == 3  # the tokens the loss sees


@pytest.mark.parametrize("left_out", ["resume_exhausted", "unscored"])
async def test_a_sample_left_out_of_the_loss_is_left_out_of_its_groups_baseline(left_out):
    """Three right answers and one partial whose resumption gave up (or one without a reward):
    masked out of the loss, it still counted as reward 0 in its group's mean, and the three
    right answers were pushed up (+0.5 each) where their group had nothing to learn (0)."""
    from rollfleet.trainer.staleness import Group

    odd = _output(0.0, exhausted=True) if left_out == "resume_exhausted" else _output(None)
    trainer = _trainer_over(learner := _AdvantageLearner())
    groups = [Group("g", [_output(1.0), _output(1.0), _output(1.0), odd], 0, 0, 0)]
    groups.append(Group("h", [_output(1.0), _output(0.0)], 0, 0, 0))  # a group of two, untouched
    metrics, trained = await trainer._train_on(groups)
    assert learner.masked_rows == [3, 3, 3, 0, 3, 3]
    assert trained == 15
    assert learner.advantages[:4] == [0.0, 0.0, 0.0, 0.0]
    assert learner.advantages[4] > 0 > learner.advantages[5]
    assert metrics["rollout/left_out_of_baseline"] == 1.0
    assert metrics["reward/mean"] == pytest.approx(4 / 5)


async def test_a_task_stream_that_fails_stops_the_run_instead_of_hanging_it():
    """The rollouter's loop died with the stream's error, unseen: the trainer waited forever."""

    class Failing:
        position = 0

        def next(self) -> dict:
            self.position += 1
            if self.position > 3:
                raise OSError("dataset shard unreadable")
            return {"task_index": self.position - 1}

    buffer = GroupBuffer(capacity=8, max_off_policy_steps=2, strategy="drop", groups_per_version=4, version=lambda: 0)
    rollouter = Rollouter(
        InstantAgents(), Failing(), buffer, n=2, max_inflight_groups=8, partial_rollout=True, version=lambda: 0
    )
    rollouter.start()
    with pytest.raises(RuntimeError, match="dataset shard unreadable"):
        await asyncio.wait_for(buffer.take(4), 5)
    assert buffer.started == 3  # the failed start gave its ticket back
    await rollouter.stop()


async def test_trained_tokens_are_those_the_batch_kept_of_a_response_longer_than_its_width():
    """A loop that returned more than response_length tokens: collate cuts it, and the count of
    trained tokens counted past the cut."""
    from rollfleet.agent_loop.base import AgentLoopOutput
    from rollfleet.trainer.staleness import Group

    extra = {"resume_exhausted": False, "min_global_steps": 0, "max_global_steps": 0}
    long = AgentLoopOutput([1, 2], [5, 6, 7, 8, 9, 10], [1] * 6, reward_score=1.0, extra_fields=dict(extra))
    trainer = _trainer_over(learner := _AdvantageLearner())
    _, trained = await trainer._train_on([Group("g", [long, _output(0.0)], 0, 0, 0)])
    assert learner.masked_rows == [4, 3] and trained == 7  # the width is 4
