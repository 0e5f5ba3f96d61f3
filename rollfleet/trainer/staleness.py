"""Finished GRPO groups waiting to be trained on, with a bounded queue and a staleness bound.

A group's staleness at training time is ``trainer_version - min_version``: how many weight
versions separate the policy being trained from the oldest token in the group. The bound
``max_off_policy_steps`` (``b``; fractional like verl's ``staleness_threshold``) limits two things.

How far ahead the rollouter runs, whatever the strategy (:meth:`GroupBuffer.may_start`): the
``i``-th group starts only once ``i < (version + b + 1) x groups_per_version`` (AReaL's capacity
rule, and verl's ``staleness_samples`` pause; ``i`` and ``version`` both counted from the buffer's
start, past version 0 in a resumed run, ``i`` past the groups a run resumed between two syncs
trained at its version, and net of dropped groups, which are replaced). A group started later
could only be trained past the bound: without the rule, a rollouter that outpaces the learner
fills its queue and in-flight limit with groups that ``drop`` then throws away (2.28x the tokens
trained in ``benchmarks/plan_served.py``'s plan before the rule held for every strategy).

What happens to a group that still ends up past it (a straggler, overtaken by groups that started
after it and finished first), one of three ways:

* ``drop``: discarded when the trainer samples (returned, so that their count and lengths reach
  the metrics), and the rollouter generates a replacement. Long responses take longest, so they
  are the ones that go stale: this biases training toward short answers, which is why it is not
  the only choice.
* ``wait``: nothing is ever dropped. The trainer receives groups *in the order they started*,
  waiting for a straggler rather than overtaking it. With the rule above, group ``i`` is trained
  at version ``floor(i / groups_per_version)``, no more than ``ceil(b)`` after it started. A group
  that still exceeds the bound (a resumed run re-issuing old prompts) is trained and counted.
* ``mask``: groups are delivered as they finish and never dropped; the trainer masks each *token*
  sampled more than ``b`` versions ago out of the loss (exact per-token versions, see
  ``RolloutBatch.token_versions``), counting the masked tokens.

The queue is bounded and never drops silently (verl's MessageQueue drops the oldest when full):
a full queue makes the rollouter wait.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional


@dataclass
class Group:
    """The ``n`` trajectories of one prompt."""

    uid: str
    outputs: list[Any]
    started_version: int
    min_version: int
    max_version: int
    task_index: int = -1
    resumes: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    ticket: int = -1  #: the order it started in (:meth:`GroupBuffer.wait_to_start`)

    def response_lengths(self) -> list[int]:
        """Response tokens of each trajectory (for the metrics of dropped groups)."""
        return [len(getattr(o, "response_ids", ()) or ()) for o in self.outputs]


class GroupBuffer:
    def __init__(
        self,
        capacity: int,
        max_off_policy_steps: float,
        strategy: Literal["drop", "wait", "mask"],
        groups_per_version: int,
        version: Callable[[], int],
        trained_in_version: int = 0,
    ) -> None:
        self.capacity = capacity
        self.bound = max_off_policy_steps
        self.strategy = strategy
        self.groups_per_version = groups_per_version
        self._version = version
        #: The version this buffer's first group is trained at: a resumed run starts past 0.
        self._base_version = version()
        #: Groups trained at that version before this buffer started: a run resumed between two
        #: syncs (its step not a multiple of ``parameter_sync_step``) syncs the sooner.
        self._phase = trained_in_version
        self._queue: deque[Group] = deque()
        self._changed = asyncio.Condition()
        self.started = 0  # groups the rollouter has started
        self.consumed = 0  # groups handed to the learner
        self.dropped = 0
        self.over_bound = 0  # wait mode: groups trained beyond the bound (never dropped)
        self.waits = 0  # times the rollouter was held back by the capacity rule
        self._tickets = 0  # tickets handed out so far
        self._outstanding: set[int] = set()  # tickets started and neither delivered nor abandoned
        self._failure: Optional[BaseException] = None

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def limit(self) -> int:
        """The most versions a trained token may lag: ``ceil(b)`` (a fractional ``b`` also says how
        far ahead the rollouter may run: part of a batch more)."""
        return math.ceil(self.bound)

    def staleness(self, group: Group) -> int:
        return self._version() - group.min_version

    # ------------------------------------------------------------------ rollouter side
    def may_start(self) -> bool:
        """Whether one more group may start now: queue room, and the capacity rule (module doc)."""
        if len(self._queue) >= self.capacity:
            return False
        # Groups that will be consumed at version v may start no earlier than v - bound. The count
        # starts with this buffer, so the versions are counted from its first one too.
        versions = self._version() - self._base_version
        return self.started - self.dropped + self._phase < (versions + self.bound + 1) * self.groups_per_version

    async def wait_to_start(self) -> int:
        """Wait until one more group may start; return its ticket (for :meth:`put`/:meth:`abandon`)."""
        async with self._changed:
            if not self.may_start():
                if len(self._queue) < self.capacity:
                    self.waits += 1
                await self._changed.wait_for(self.may_start)
            self.started += 1
            ticket = self._tickets
            self._tickets += 1
            self._outstanding.add(ticket)
            return ticket

    async def put(self, group: Group) -> None:
        async with self._changed:
            self._queue.append(group)
            self._changed.notify_all()

    async def abandon(self, ticket: int = -1) -> None:
        """A started group will not be delivered (it failed and is re-issued, or was cancelled)."""
        async with self._changed:
            self.started -= 1
            self._outstanding.discard(ticket)
            self._changed.notify_all()

    async def fail(self, error: BaseException) -> None:
        """The rollouter cannot go on: the trainer's next ``take`` raises ``error``."""
        async with self._changed:
            self._failure = error
            self._changed.notify_all()

    # ------------------------------------------------------------------ trainer side
    async def take(self, n: int) -> tuple[list[Group], list[Group]]:
        """Wait for ``n`` groups to train on; return them and the groups dropped meanwhile.

        ``drop``: oldest-finished first, stale ones dropped; ``mask``: oldest-finished first, none
        dropped; ``wait``: in start order, waiting for the oldest started group when it is still
        generating, none dropped."""
        taken: list[Group] = []
        dropped: list[Group] = []
        async with self._changed:
            while len(taken) < n:
                await self._changed.wait_for(lambda: self._next() is not None or self._failure is not None)
                if self._failure is not None:
                    raise RuntimeError(f"rollout failed: {self._failure!r}") from self._failure
                group = self._next()
                assert group is not None
                self._queue.remove(group)
                self._outstanding.discard(group.ticket)
                stale = self.staleness(group) > self.limit
                if stale and self.strategy == "drop":
                    dropped.append(group)
                    self.dropped += 1
                else:
                    self.over_bound += int(stale and self.strategy == "wait")
                    taken.append(group)
                    self.consumed += 1
                self._changed.notify_all()
        return taken, dropped

    def _next(self) -> Optional[Group]:
        """The group :meth:`take` hands out next, if it has finished."""
        if not self._queue:
            return None
        if self.strategy != "wait":
            return self._queue[0]
        head = min(self._outstanding, default=None)
        for group in self._queue:
            if group.ticket == head or group.ticket < 0:  # untracked groups (tests) go as they come
                return group
        return None

    async def version_changed(self) -> None:
        """Wake a rollouter held by the capacity rule after a weight sync."""
        async with self._changed:
            self._changed.notify_all()


__all__ = ["Group", "GroupBuffer"]
