"""``routing.dispatch_order: longest_group_first``: the probe of each prompt first, then the
siblings of the prompts whose probes ran longest.

Why: once every slot is busy, a rollout's makespan is decided by its drain, the samples
that start last. A long one started late runs alone at a small batch size while the rest of the
fleet idles. Response lengths are unknown in advance, but the samples of one prompt have related
lengths (a hard prompt makes every sample long). The probe's run time estimates its group's:
finished, its duration; still running, its age so far, a lower bound that grows. Sending the
longest-estimated groups first leaves the short ones for the end, the idea of Seer's
context-aware scheduling (Moonshot, 2025). Measured in virtual time with
``benchmarks/routing_quality.py``: see the README's routing-quality table. The price: a sibling
that goes later may find its prompt's replica full and prefill the prompt again elsewhere.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import count
from typing import ClassVar, Optional, Sequence

from cachetools import LRUCache

from rollfleet.client.dispatch.fifo import DispatchGate, RoomFn
from rollfleet.routing.policies.prefix_affinity import prefix_key
from rollfleet.utils import virtual_time


@dataclass(eq=False)
class _Group:
    """The held samples of one prompt and what its probe has shown."""

    waiters: deque["_Waiter"] = field(default_factory=deque)
    probe_start: Optional[float] = None  # when its first sample (the probe) went (None: none has)
    duration: Optional[float] = None  # how long the probe ran (None: it runs)
    home: Optional[str] = None  # the replica its last sample went to (its prompt is cached there)


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[None]
    request_id: str
    slot: Optional[str] = None  # the replica whose free slot it was woken for


_Entry = tuple[float, int, _Group]  # (sort key, tie-break, group)


@dataclass
class _Queue:
    """The groups homed on one replica that have samples held: by probe start while the probe
    runs (the oldest is the longest so far), by minus its duration once it finished."""

    running: list[_Entry] = field(default_factory=list)
    done: list[_Entry] = field(default_factory=list)


class LongestGroupFirstGate(DispatchGate):
    """Probes first (in arrival order), then siblings, each replica taking the longest-estimated
    group whose prompt it caches, or, when it caches none that waits, the longest anywhere (it
    becomes that group's home: one more prefill of its prompt, no idle slot).

    Probes go first only while few siblings are held behind probed groups (:meth:`_pool_target`):
    enough to rank the work that fills the fleet while the longest sample runs, no more. Probing
    every prompt first holds the shortest groups for most of the rollout, and by then their
    prompts have left the prefix cache (measured on ``grpo capacity``: 1.19x the group prompt
    prefilled at twice the default lookahead, 1.15x at it; 1.41x and 1.19x when the sim engine's
    prefix cache was an LRU apart from its KV blocks). A replica with none of its own groups
    waiting probes a new prompt even past that target before it steals: that prompt's prefill is
    due anyway, a stolen group's is one more.

    Heap entries go stale when a group's waiters run out, its probe finishes or it moves home;
    stale ones are skipped when they reach the top. A wake hands out each replica's free slots
    once; a woken waiter holds its slot until it has tried for a replica, so two wakes in one tick
    do not hand out one slot twice.
    """

    holds_placed: ClassVar[bool] = True

    def __init__(
        self, room: Optional[RoomFn] = None, limit: int = 0, lookahead: float = 1.0, max_groups: int = 65536
    ) -> None:
        super().__init__(room, limit, lookahead)
        if room is None:
            raise ValueError("longest_group_first needs the balancer's free slots (room)")
        self._room = room
        self._limit = limit
        self._lookahead = lookahead
        self._pool: set[_Group] = set()  # probed groups with samples held
        self._pool_samples = 0  # their samples held
        self._probe_time = 0.0  # summed over finished probes
        self._probes_done = 0
        self._longest = 0.0  # the longest probe so far
        self._groups: LRUCache[int, _Group] = LRUCache(maxsize=max_groups)
        # a probe's request id -> its group (bounded: a probe given up on never ends)
        self._probes: LRUCache[str, _Group] = LRUCache(maxsize=max_groups)
        self._fresh: deque[_Group] = deque()
        self._queues: dict[Optional[str], _Queue] = {}  # by home (None: its probe has not landed yet)
        self._seq = count()
        self._held = 0
        self._granted: Counter[str] = Counter()  # woken for a replica's slot, not yet back from their try
        self._scheduled = False

    @property
    def waiting(self) -> int:
        return self._held

    def may_try(self, placed: bool) -> bool:
        return placed  # everyone else queues, so that the order decides, not arrival

    async def wait(
        self, front: bool = False, *, request_id: str = "", prompt_ids: Optional[Sequence[int]] = None
    ) -> None:
        key = prefix_key(prompt_ids or ())
        group = self._group(key)
        waiter = _Waiter(asyncio.get_running_loop().create_future(), request_id)
        if front:
            group.waiters.appendleft(waiter)
        else:
            group.waiters.append(waiter)
        self._held += 1
        if len(group.waiters) == 1:
            self._enqueue(group)
        elif group in self._pool:
            self._pool_samples += 1
        if not self._scheduled:  # arrivals of this tick are all in before anyone is picked
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter in group.waiters:
                group.waiters.remove(waiter)
                self._held -= 1
                if group in self._pool:
                    self._pool_samples -= 1
                    if not group.waiters:
                        self._pool.discard(group)
            elif not waiter.future.cancelled():  # picked, then cancelled before its try
                self._ungrant(waiter)
                self._unprobe(request_id)
                self._drain()  # the slot goes to the next
            raise
        self._ungrant(waiter)

    def wake(self, everyone: bool) -> None:
        self._drain()

    def dispatched(self, request_id: str, prompt_ids: Sequence[int], replica_id: str) -> None:
        group = self._group(prefix_key(prompt_ids))
        if group.home != replica_id:
            group.home = replica_id
            if group.waiters:
                self._enqueue(group)

    def finished(self, request_id: str, ended: bool = True) -> None:
        if not ended:  # resumed or retried under its id, or given up: its age keeps counting
            return
        group = self._probes.pop(request_id, None)
        if group is not None and group.duration is None and group.probe_start is not None:
            group.duration = virtual_time.now() - group.probe_start
            self._probe_time += group.duration
            self._probes_done += 1
            self._longest = max(self._longest, group.duration)
            if group.waiters:
                self._enqueue(group)  # its siblings now rank by the probe's duration

    def _unprobe(self, request_id: str) -> None:
        """A probe cancelled before it ran shows nothing of its group: the group is unprobed
        again, first in line, so that its next sample probes it (its probe's age, counted in the
        heaps, is void)."""
        group = self._probes.pop(request_id, None)
        if group is None or group.duration is not None:
            return
        group.probe_start = None
        if group.waiters:
            if group in self._pool:
                self._pool.discard(group)
                self._pool_samples -= len(group.waiters)
            self._fresh.appendleft(group)

    # ------------------------------------------------------------------ ordering
    def _group(self, key: int) -> _Group:
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group()
        return group

    def _queue(self, home: Optional[str]) -> _Queue:
        queue = self._queues.get(home)
        if queue is None:
            queue = self._queues[home] = _Queue()
        return queue

    def _enqueue(self, group: _Group) -> None:
        if group.probe_start is None:
            self._fresh.append(group)
            return
        if group not in self._pool:
            self._pool.add(group)
            self._pool_samples += len(group.waiters)
        if group.duration is None:
            heapq.heappush(self._queue(group.home).running, (group.probe_start, next(self._seq), group))
        else:
            heapq.heappush(self._queue(group.home).done, (-group.duration, next(self._seq), group))

    def _pool_target(self, replicas: int) -> float:
        """Siblings to hold behind probed groups before probing more: enough to keep the fleet's
        dispatch slots (``replicas`` x the limit) busy for as long as the longest sample seen runs
        (its duration over the mean is how many waves of those slots that is), times
        ``lookahead``. Unbounded until a probe ends."""
        if not self._probes_done or self._probe_time <= 0:
            return float("inf")
        waves = self._longest / (self._probe_time / self._probes_done)
        return self._lookahead * waves * self._limit * replicas

    def _ungrant(self, waiter: _Waiter) -> None:
        if waiter.slot is not None:
            self._granted[waiter.slot] -= 1
            waiter.slot = None

    def _drain(self) -> None:
        self._scheduled = False
        rooms = self._room()
        if rooms is None:  # nothing routable: let them all try (and wait it out in the retry policy)
            while (waiter := self._pick(None, steal=True, target=float("inf"))) is not None:
                self._release(waiter, None)
            return
        target = self._pool_target(len(rooms))  # no probe ends during a wake: the same for all picks
        free = {replica_id: n - self._granted[replica_id] for replica_id, n in rooms.items()}
        for steal in (False, True):  # every replica takes its own groups before any steals
            for replica_id in free:
                while free[replica_id] > 0 and self._held:
                    waiter = self._pick(replica_id, steal, target)
                    if waiter is None:
                        break
                    if self._release(waiter, replica_id):
                        free[replica_id] -= 1

    def _release(self, waiter: _Waiter, replica_id: Optional[str]) -> bool:
        self._held -= 1
        if waiter.future.done():  # cancelled in the tick it was picked: if it was to probe, it never will
            self._unprobe(waiter.request_id)
            return False
        waiter.future.set_result(None)
        if replica_id is not None:
            waiter.slot = replica_id
            self._granted[replica_id] += 1
        return True

    def _pick(self, replica_id: Optional[str], steal: bool, target: float) -> Optional[_Waiter]:
        """The next waiter for a free slot on ``replica_id`` (``steal``: from any replica's groups
        when none of its own waits; ``target``: :meth:`_pool_target`)."""
        waiter = self._probe(target)
        if waiter is not None:
            return waiter
        now = virtual_time.now()
        own = self._best(self._queues.get(replica_id), replica_id, now) if replica_id is not None else None
        if own is None and steal:
            # nothing cached here waits: a new prompt's probe first, past the pool's target (that
            # prefill is due anyway), then the longest group anywhere (one more prefill of it)
            waiter = self._probe(float("inf"))
            if waiter is not None:
                return waiter
            tops = (self._best(queue, home, now) for home, queue in self._queues.items())
            own = max((top for top in tops if top is not None), key=lambda top: top[0], default=None)
        if own is None:
            return None
        _, heap = own
        group = heap[0][2]
        waiter = group.waiters.popleft()
        self._pool_samples -= 1
        if not group.waiters:
            heapq.heappop(heap)
            self._pool.discard(group)
        return waiter

    def _probe(self, target: float) -> Optional[_Waiter]:
        """The first sample of the next unprobed prompt, while the siblings held behind probed
        groups are fewer than ``target`` (or none is)."""
        while self._fresh and (self._pool_samples < target or not self._pool):
            group = self._fresh.popleft()
            if not group.waiters or group.probe_start is not None:
                if group.waiters:  # its probe went since
                    self._enqueue(group)
                continue
            waiter = group.waiters.popleft()
            group.probe_start = virtual_time.now()  # its siblings now rank by the probe's age
            self._probes[waiter.request_id] = group
            if group.waiters:
                self._enqueue(group)
            return waiter
        return None

    @staticmethod
    def _best(queue: Optional[_Queue], home: Optional[str], now: float) -> Optional[tuple[float, list[_Entry]]]:
        """(estimated run time, heap) of the queue's longest group, stale entries popped."""
        if queue is None:
            return None
        best: Optional[tuple[float, list[_Entry]]] = None
        for heap, done in ((queue.running, False), (queue.done, True)):
            while heap:
                group = heap[0][2]
                if done:
                    current = group.duration is not None
                else:  # a probe cancelled before it ran voids its entries
                    current = group.duration is None and group.probe_start == heap[0][0]
                if group.waiters and group.home == home and current:
                    estimate = -heap[0][0] if done else now - heap[0][0]
                    if best is None or estimate > best[0]:
                        best = (estimate, heap)
                    break
                heapq.heappop(heap)
        return best


__all__ = ["LongestGroupFirstGate"]
