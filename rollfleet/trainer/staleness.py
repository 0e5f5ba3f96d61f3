"""Finished GRPO groups waiting to be trained on, with a bounded queue and a staleness bound.

A group's staleness at training time is ``trainer_version - min_version``: how many weight
versions separate the policy being trained from the oldest token in the group. No group beyond
``max_off_policy_steps`` is ever handed to the learner:

* ``drop``: stale groups are discarded when the trainer samples (counted), and the rollouter,
  which keeps the queue topped up, generates replacements;
* ``wait``: the rollouter is held back (:meth:`GroupBuffer.may_start`) so that groups are not
  started further ahead of the trainer than the bound allows (AReaL's capacity rule,
  ``started <= (version + bound + 1) x groups_per_version``); the final filter still applies.

The queue is bounded and never drops silently (verl's MessageQueue drops the oldest when full):
a full queue makes the rollouter wait.
"""

from __future__ import annotations

import asyncio
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


class GroupBuffer:
    def __init__(
        self,
        capacity: int,
        max_off_policy_steps: int,
        strategy: Literal["drop", "wait"],
        groups_per_version: int,
        version: Callable[[], int],
    ) -> None:
        self.capacity = capacity
        self.bound = max_off_policy_steps
        self.strategy = strategy
        self.groups_per_version = groups_per_version
        self._version = version
        self._queue: deque[Group] = deque()
        self._changed = asyncio.Condition()
        self.started = 0  # groups the rollouter has started
        self.consumed = 0  # groups handed to the learner
        self.dropped = 0
        self.waits = 0  # times the rollouter was held back by the staleness bound
        self._failure: Optional[BaseException] = None

    def __len__(self) -> int:
        return len(self._queue)

    def staleness(self, group: Group) -> int:
        return self._version() - group.min_version

    # ------------------------------------------------------------------ rollouter side
    def may_start(self) -> bool:
        """Whether one more group may start now (queue room and, with ``wait``, the bound)."""
        if len(self._queue) >= self.capacity:
            return False
        if self.strategy == "wait":
            # Groups that will be consumed at version v may start no earlier than v - bound.
            return self.started - self.dropped < (self._version() + self.bound + 1) * self.groups_per_version
        return True

    async def wait_to_start(self) -> None:
        async with self._changed:
            if not self.may_start():
                if self.strategy == "wait" and len(self._queue) < self.capacity:
                    self.waits += 1
                await self._changed.wait_for(self.may_start)
            self.started += 1

    async def put(self, group: Group) -> None:
        async with self._changed:
            self._queue.append(group)
            self._changed.notify_all()

    async def abandon(self) -> None:
        """A started group will not be delivered (it is being regenerated or was cancelled)."""
        async with self._changed:
            self.started -= 1
            self._changed.notify_all()

    async def fail(self, error: BaseException) -> None:
        """The rollouter cannot go on: the trainer's next ``take`` raises ``error``."""
        async with self._changed:
            self._failure = error
            self._changed.notify_all()

    # ------------------------------------------------------------------ trainer side
    async def take(self, n: int) -> tuple[list[Group], int]:
        """Wait for ``n`` fresh-enough groups (oldest first); return them and how many were dropped."""
        taken: list[Group] = []
        dropped = 0
        async with self._changed:
            while len(taken) < n:
                await self._changed.wait_for(lambda: len(self._queue) > 0 or self._failure is not None)
                if self._failure is not None:
                    raise RuntimeError(f"rollout failed: {self._failure!r}") from self._failure
                group = self._queue.popleft()
                if self.staleness(group) > self.bound:
                    dropped += 1
                    self.dropped += 1
                else:
                    taken.append(group)
                    self.consumed += 1
                self._changed.notify_all()
        return taken, dropped

    async def version_changed(self) -> None:
        """Wake a rollouter held by the bound after a weight sync."""
        async with self._changed:
            self._changed.notify_all()


__all__ = ["Group", "GroupBuffer"]
