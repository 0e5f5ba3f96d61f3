"""The group buffer's staleness strategies, driven by hand (no fleet): drop, wait, mask."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError
from trainer_support import InstantAgents

from rollfleet.config import load_config
from rollfleet.trainer.rollouter import Rollouter
from rollfleet.trainer.staleness import Group, GroupBuffer

pytestmark = pytest.mark.unit


def _group(ticket: int, started: int, length: int) -> Group:
    outputs = [SimpleNamespace(response_ids=[1] * length)]
    return Group(f"g{ticket}", outputs, started, started, started, task_index=ticket, ticket=ticket)


class Clock:
    def __init__(self) -> None:
        self.version = 0

    def __call__(self) -> int:
        return self.version


async def test_wait_delivers_in_start_order_and_never_drops():
    """A long group that started first is trained first, even when short ones finish before it:
    the trainer waits for it rather than letting it go stale (the bias toward short answers)."""
    clock = Clock()
    buf = GroupBuffer(capacity=8, max_off_policy_steps=1, strategy="wait", groups_per_version=2, version=clock)
    tickets = [await buf.wait_to_start() for _ in range(4)]
    assert tickets == [0, 1, 2, 3]
    assert not buf.may_start()  # (version 0 + bound 1 + 1) x 2 groups per version started
    await buf.put(_group(1, 0, 5))  # short ones finish first
    await buf.put(_group(2, 0, 5))
    await buf.put(_group(3, 0, 5))
    take = asyncio.create_task(buf.take(2))
    await asyncio.sleep(0.05)
    assert not take.done()  # group 0, the long one, is still generating: the trainer waits
    await buf.put(_group(0, 0, 400))
    taken, dropped = await asyncio.wait_for(take, 1)
    assert [g.ticket for g in taken] == [0, 1] and dropped == []
    clock.version = 3  # far beyond the bound: wait still trains, counts, never drops
    taken, dropped = await buf.take(2)
    assert [g.ticket for g in taken] == [2, 3] and dropped == []
    assert buf.dropped == 0 and buf.over_bound == 2


async def test_wait_skips_abandoned_tickets():
    buf = GroupBuffer(capacity=8, max_off_policy_steps=2, strategy="wait", groups_per_version=4, version=Clock())
    for _ in range(3):
        await buf.wait_to_start()
    await buf.abandon(0)  # failed; its prompt is re-issued under a new ticket
    await buf.put(_group(2, 0, 3))
    await buf.put(_group(1, 0, 3))
    taken, _ = await asyncio.wait_for(buf.take(2), 1)
    assert [g.ticket for g in taken] == [1, 2]


async def test_drop_returns_the_dropped_groups_with_their_lengths():
    clock = Clock()
    buf = GroupBuffer(capacity=8, max_off_policy_steps=0, strategy="drop", groups_per_version=3, version=clock)
    for _ in range(3):
        await buf.wait_to_start()
    await buf.put(_group(0, 0, 300))
    clock.version = 1
    await buf.put(_group(1, 1, 10))
    await buf.put(_group(2, 1, 12))
    taken, dropped = await buf.take(2)
    assert [g.ticket for g in taken] == [1, 2]
    assert [g.response_lengths() for g in dropped] == [[300]]
    assert buf.dropped == 1


async def test_mask_delivers_as_finished_and_drops_nothing():
    clock = Clock()
    buf = GroupBuffer(capacity=8, max_off_policy_steps=0.5, strategy="mask", groups_per_version=2, version=clock)
    assert buf.limit == 1  # a fraction bounds tokens at its ceiling
    await buf.wait_to_start()
    await buf.wait_to_start()
    await buf.put(_group(1, 0, 3))
    clock.version = 5
    await buf.put(_group(0, 0, 3))
    taken, dropped = await buf.take(2)
    assert [g.ticket for g in taken] == [1, 0] and dropped == []


async def test_fractional_bound_lets_the_rollouter_run_part_of_a_batch_ahead():
    buf = GroupBuffer(capacity=99, max_off_policy_steps=0.5, strategy="wait", groups_per_version=4, version=Clock())
    started = 0
    while buf.may_start():
        await buf.wait_to_start()
        started += 1
    assert started == 6  # (0 + 0.5 + 1) x 4


class Prompts:
    def __init__(self) -> None:
        self.index = 0

    def next(self) -> dict:
        self.index += 1
        return {"task_index": self.index - 1}


class ReissuingPrompts(Prompts):
    """Prompts, a failed one of which is taken again by its index."""

    def sample_at(self, index: int) -> dict:
        return {"task_index": index}


def reissuing_rollouter(agents: Any, *, groups_per_version: int, max_inflight_groups: int) -> tuple:
    """A drop-strategy buffer (bound 1) and a rollouter of ``agents`` over re-issuable prompts."""
    clock = Clock()
    buffer = GroupBuffer(
        capacity=8, max_off_policy_steps=1, strategy="drop", groups_per_version=groups_per_version, version=clock
    )
    rollouter = Rollouter(
        agents, ReissuingPrompts(), buffer, n=2, max_inflight_groups=max_inflight_groups, partial_rollout=True,
        version=clock,
    )  # fmt: skip
    return clock, buffer, rollouter


@pytest.mark.parametrize("strategy", ["drop", "wait", "mask"])
async def test_every_strategy_keeps_the_rollouter_within_the_bound_ahead_of_the_learner(strategy: str):
    """A rollouter that outpaces its learner starts no group that could only be trained past the
    bound: (version + bound + 1) x groups per version, whatever the queue and in-flight limits
    allow. Under drop it used to fill both with groups it then threw away (2.28x the tokens
    trained in benchmarks/plan_served.py's plan)."""
    clock = Clock()
    buffer = GroupBuffer(capacity=64, max_off_policy_steps=1, strategy=strategy, groups_per_version=2, version=clock)
    rollouter = Rollouter(
        InstantAgents(), Prompts(), buffer, n=2, max_inflight_groups=64, partial_rollout=True, version=clock
    )
    rollouter.start()
    try:
        await asyncio.sleep(0.05)
        assert buffer.started == 4 and len(buffer) == 4  # (0 + 1 + 1) x 2
        assert buffer.waits == 1  # held by the bound, not by the queue
        for version in (1, 2, 3):
            taken, dropped = await asyncio.wait_for(buffer.take(2), 1)
            assert len(taken) == 2 and dropped == []  # nothing started past the bound
            clock.version = version
            await buffer.version_changed()
            await asyncio.sleep(0.05)
            assert buffer.started == 2 * (version + 2) and len(buffer) == 4
    finally:
        await rollouter.stop()
    assert buffer.dropped == 0


async def test_the_step_metrics_count_the_rollouts_that_failed():
    """A trajectory that raises is retried (its prompt re-issued) and the run goes on; the step's
    metrics say how many did, which a run used to count and never report."""
    from rollfleet.trainer.modes.separate_async import SeparateAsyncTrainer

    class FailsOnce(InstantAgents):
        failed = False

        async def generate_sequences_single(self, sample: dict) -> Any:
            if sample["task_index"] == 0 and not self.failed:
                self.failed = True
                raise RuntimeError("this trajectory failed")
            return await super().generate_sequences_single(sample)

    clock, buffer, rollouter = reissuing_rollouter(FailsOnce(), groups_per_version=2, max_inflight_groups=4)
    trainer = SeparateAsyncTrainer.__new__(SeparateAsyncTrainer)  # its sampling hook alone, no fleet
    trainer.buffer, trainer.rollouter = buffer, rollouter
    trainer.train = SimpleNamespace(train_batch_size=2)
    rollouter.start()
    try:
        groups, metrics = await asyncio.wait_for(trainer.sample(), 1)
    finally:
        await rollouter.stop()
    assert len(groups) == 2 and metrics["rollout/errors"] == 1


async def test_a_prompt_that_always_fails_stops_the_run_though_other_groups_succeed_between():
    """The run stopped only after 3 failures in a row: a prompt that always fails, its tries
    interleaved with other prompts' successes, was re-issued for the whole run (50 steps, 50
    failed tries, never trained). Now its third failure stops the run, naming it."""

    class AlwaysFailsOn3(InstantAgents):
        async def generate_sequences_single(self, sample: dict) -> Any:
            if sample["task_index"] == 3:
                raise ValueError("prompt too long")
            return await super().generate_sequences_single(sample)

    clock, buffer, rollouter = reissuing_rollouter(AlwaysFailsOn3(), groups_per_version=4, max_inflight_groups=8)
    rollouter.start()
    try:
        with pytest.raises(
            RuntimeError, match=r"the rollout of prompt 3 failed 3 times: ValueError\('prompt too long'\)"
        ):
            for _ in range(50):
                await asyncio.wait_for(buffer.take(4), 5)
                clock.version += 1
                await buffer.version_changed()
    finally:
        await rollouter.stop()
    assert rollouter.errors == 3 and 3 in rollouter.inflight_task_indices()  # a checkpoint keeps it


def test_mask_strategy_takes_stale_tokens_and_exhausted_partials_out_of_the_loss():
    import torch

    from rollfleet.trainer.base import Trainer

    batch = SimpleNamespace(
        response_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]),
        token_versions=torch.tensor([[2, 3, 5, -1], [5, 5, -1, -1], [4, 4, 5, 5]]),
        resume_exhausted=torch.tensor([False, False, True]),
    )
    owner = SimpleNamespace(train=SimpleNamespace(max_off_policy_strategy="mask", max_off_policy_steps=1.5), version=5)
    metrics = Trainer._mask_off_policy(owner, batch)  # type: ignore[arg-type]
    # bound ceil(1.5) = 2: at version 5, tokens of versions 2 (and older) go; version 3 stays
    assert batch.response_mask.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert metrics == {"rollout/resume_exhausted_masked": 1.0, "staleness/masked_tokens": 1.0}
    owner.train.max_off_policy_strategy = "drop"  # other strategies leave tokens alone
    batch.response_mask = torch.ones(3, 4, dtype=torch.long)
    assert Trainer._mask_off_policy(owner, batch) == {"rollout/resume_exhausted_masked": 1.0}


async def test_a_failed_sample_stops_its_siblings_and_its_prompt_is_reissued():
    """One sample of a group fails: its siblings are cancelled (not left generating, unseen and past
    max_inflight_groups, while the prompt runs again) and the prompt is re-issued once."""
    running: set[str] = set()
    starts: list[int] = []

    class Agents:
        def expand(self, batch: list[dict], n: int) -> list[dict]:
            return [{**batch[0], "uid": f"u{batch[0]['task_index']}", "k": k} for k in range(n)]

        async def generate_sequences_single(self, sample: dict) -> Any:
            key = f"{sample['task_index']}-{sample['k']}-{len(starts)}"
            running.add(key)
            try:
                if sample["k"] == 0 and sample["task_index"] == 0 and starts.count(0) == 1:
                    await asyncio.sleep(0.01)
                    raise RuntimeError("this sample's trajectory failed")
                await asyncio.sleep(3600)
            finally:
                running.discard(key)

    class Stream:
        def __init__(self) -> None:
            self.index = 0

        def next(self) -> dict:
            self.index += 1
            starts.append(self.index - 1)
            return {"task_index": self.index - 1}

        def sample_at(self, index: int) -> dict:
            starts.append(index)
            return {"task_index": index}

    buffer = GroupBuffer(capacity=8, max_off_policy_steps=1, strategy="drop", groups_per_version=1, version=Clock())
    rollouter = Rollouter(Agents(), Stream(), buffer, n=4, max_inflight_groups=1, partial_rollout=True, version=Clock())
    rollouter.start()
    await asyncio.sleep(0.1)
    assert rollouter.errors == 1 and starts == [0, 0]  # the failed prompt, then the same one again
    assert sorted(running) == [f"0-{k}-2" for k in range(4)]  # only the re-issued group runs
    await rollouter.stop()
    assert not running


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("trainer.max_off_policy_steps", float("inf")),
        ("trainer.learner.lr", float("nan")),
        ("rollout.sim.time_scale", float("inf")),
    ],
)
def test_a_config_number_that_is_not_finite_is_refused_naming_the_field(key, value):
    """An infinite staleness bound (meant as "unbounded") passed ge=0 and crashed the first step
    with a bare OverflowError from math.ceil."""
    with pytest.raises(ValidationError, match=rf"(?s){re.escape(key)}.*finite number"):
        load_config(None, {key: value})


async def test_without_partial_rollout_a_group_a_sync_split_between_turns_is_generated_again():
    """A multi-turn trajectory whose first turn ran on version 0 and second on 1, neither
    aborted (the sync fell between them): delivered and trained as one policy's response."""
    import asyncio
    from types import SimpleNamespace

    from rollfleet.trainer.rollouter import Rollouter
    from rollfleet.trainer.tasks import make_task

    calls = [0]

    class TwoTurnAgents:
        def expand(self, batch, n):
            return [{**batch[0], "uid": f"u{batch[0]['task_index']}", "k": k} for k in range(n)]

        async def generate_sequences_single(self, sample):
            await asyncio.sleep(0)
            calls[0] += 1
            lo = 0 if calls[0] <= 2 else 1  # the first group's turns fell either side of a sync
            fields = {"min_global_steps": lo, "max_global_steps": 1, "termination": "no_tool_call"}
            return SimpleNamespace(extra_fields=fields, metrics=SimpleNamespace(num_resumes=0),
                                   response_mask=[1, 0, 1], response_ids=[1, 2, 3])  # fmt: skip

    buffer = GroupBuffer(capacity=4, max_off_policy_steps=4, strategy="drop", groups_per_version=2, version=lambda: 1)
    rollouter = Rollouter(TwoTurnAgents(), make_task("count"), buffer, n=2, max_inflight_groups=1,
                          partial_rollout=False, version=lambda: 1)  # fmt: skip
    rollouter.start()
    groups, _ = await buffer.take(1)
    await rollouter.stop()
    assert (groups[0].min_version, groups[0].max_version, rollouter.regenerated) == (1, 1, 1)
