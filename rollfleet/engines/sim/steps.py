"""The sim engine's step loop: engine steps paced on the event loop's clock, one at a time or,
where nothing can change for many steps, many at once (a fast-forward).

Why fast-forward: a plan of a large cluster runs billions of sequence-steps; a timer per step per
replica and Python work per token make that minutes of wall time per plan. Between two events that
change the batch (a sequence ending, a request arriving or aborted, a pause, a weight commit, a KV
block that cannot be had without preempting), every step is known in advance: the batch is fixed,
its context grows by one token per sequence per step, so each step's cost follows, and its tokens
are a function of the weights, the request and the position. So the loop plans the steps up to the
next such event (at most ``max_steps_per_wake``), sleeps once until the last ends, and only counts
the tokens; they are produced, vectorised, when a request leaves the batch or the weights change
(:meth:`BatchModel._materialize`).

An event that arrives mid-way (:meth:`StepLoop._catch_up`) first settles the steps that ended by
then; the step in progress still ends when it was planned to, as a real engine step does, and the
loop plans again from there. So the engine does what it does one step at a time (its step ends are
the same, to the rounding of sums), except that a streamed request always steps one at a time (its
caller sees every token as it comes) and a fast-forward's tokens reach ``profile`` as one event.
``max_steps_per_wake: 1`` (the default) is the step-at-a-time loop.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from rollfleet.engines.sim.batch import BatchModel, _Request
from rollfleet.engines.sim.cost import StepCost
from rollfleet.errors import EngineDead


@dataclass
class _Run:
    """The steps planned at one wake: when each ends (loop clock), what each costs (ms)."""

    ends: list[float]
    costs_ms: list[float]
    prefill: int
    counted: bool = False  # the tokens are counted and produced later (a fast-forward), not emitted
    done: int = 0  # steps settled so far
    started: float = field(default_factory=time.perf_counter)

    @property
    def planned(self) -> int:
        return len(self.ends)


def _wake(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)


class StepLoop(BatchModel):
    """The step loop half of :class:`~rollfleet.engines.sim.SimEngine` (its state is the engine's)."""

    _cost: StepCost
    _paused: bool
    _loading: int
    _sleeping: bool
    _hung: bool
    _dead: Optional[str]
    _slow_factor: float
    _sim_clock: float
    _work: Optional[asyncio.Event]
    _profile: Optional[list[dict[str, Any]]]
    _run_now: Optional[_Run]
    _wake_at: Optional[tuple["asyncio.Future[None]", asyncio.TimerHandle]]

    async def _run(self) -> None:
        """The step loop; should it ever crash, the engine is dead and every request hears so
        (rather than waiting forever on a loop that is gone)."""
        try:
            await self._steps()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._dead = f"engine loop crashed: {exc!r}"
            self._fail_all(EngineDead(f"sim-{self.replica_index}", self._dead))

    def _stopped(self) -> bool:
        return self._paused or self._loading > 0 or self._sleeping or self._hung or self._dead is not None

    async def _steps(self) -> None:
        assert self._work is not None
        anchor: Optional[tuple[float, float]] = None  # (loop clock, simulated) time when busy began
        loop = asyncio.get_running_loop()
        while True:
            if self._dead is not None:
                return
            if self._stopped() or not self._requests:
                anchor = None
                self._work.clear()
                await self._work.wait()
                continue
            prefill = self._admit()
            if not self._running:
                anchor = None
                self._work.clear()
                await self._work.wait()
                continue
            # Pace against an anchor (sub-ms steps would each pay the sleep overhead), on the loop's
            # clock: on a virtual-time loop (rollfleet.utils.virtual_time) steps take no wall time.
            if anchor is None:
                anchor = (loop.time(), self._sim_clock)
            run = self._plan(prefill, anchor)
            self._run_now = run
            try:
                if run.planned == 1:
                    await asyncio.sleep(max(0.0, run.ends[0] - loop.time()))
                else:
                    await self._sleep_until(run.ends[-1])
            finally:  # cancelled (a shutdown), it must not be settled by a restarted engine
                self._run_now = None
            if self._stopped():  # the step in progress was interrupted: its tokens are not emitted,
                self._left_in_prefill.clear()  # and the prefills it was doing are not cached
                continue
            if self._slow_factor != 1.0:
                anchor = None
            self._settle(run, run.planned)

    def _plan(self, prefill: int, anchor: tuple[float, float]) -> _Run:
        """The steps to take at this wake: up to the first that may change the batch."""
        steps, counted = self._steps_ahead()
        running = len(self._running)
        context = sum(r.context_len for r in self._running)  # KV the first step reads
        scale = self.config.time_scale
        self._stats["num_wakes"] += 1
        if steps == 1:
            ms = self._cost.step_ms(running, context, prefill) * self._slow_factor
            return _Run([anchor[0] + (self._sim_clock + ms / 1000.0 - anchor[1]) / scale], [ms], prefill, counted)
        # The same arithmetic, a step per element; cumsum adds in order, as a loop would.
        cost = self._cost
        contexts = context + np.arange(steps, dtype=np.float64) * running
        costs = cost.base_ms + cost.per_seq_ms * running + cost.per_context_token_ms * contexts
        costs[0] += cost.per_prefill_token_ms * prefill
        costs *= self._slow_factor
        sims = costs / 1000.0
        sims[0] += self._sim_clock
        ends = anchor[0] + (np.cumsum(sims) - anchor[1]) / scale
        return _Run(ends.tolist(), costs.tolist(), prefill, True)

    def _steps_ahead(self) -> tuple[int, bool]:
        """How many steps can run before one may change the batch (none of them ends a sequence
        but the last, none needs a KV block that is not free, no sequence streams), and whether
        they can be counted rather than emitted token by token. A single step is counted too
        unless it must be emitted (a stream, an end not known ahead, a block only preemption can
        free): emitting materializes every running sequence's tokens at each such wake (8% of a
        ``separate_async`` plan's profile, where sequences of a big batch end a step apart)."""
        limit = self.config.max_steps_per_wake
        if limit == 1:
            return 1, False
        for req in self._running:
            if req.progress is not None or not req.end_at:
                return 1, False
            limit = min(limit, req.end_at - len(req.generated) - req.pending)
        limit = max(1, limit)
        if self._blocks_needed(limit) > self._kv_blocks_free:
            if limit == 1:
                return 1, False
            low, high = 1, limit - 1  # the most steps whose blocks are free (needs grow with steps)
            while low < high:
                mid = (low + high + 1) // 2
                if self._blocks_needed(mid) <= self._kv_blocks_free:
                    low = mid
                else:
                    high = mid - 1
            limit = low
            if self._blocks_needed(limit) > self._kv_blocks_free:
                return 1, False
        return limit, True

    def _blocks_needed(self, steps: int) -> int:
        size = self.config.block_size
        return sum(
            max(0, -(-(len(r.prompt_ids) + len(r.generated) + r.pending + steps) // size) - r.blocks)
            for r in self._running
        )

    def _settle(self, run: _Run, upto: int) -> None:
        """Account for the steps of ``run`` that have ended, up to ``upto``."""
        steps = upto - run.done
        if steps <= 0:
            return
        if run.done == 0:
            self._unpaid.clear()  # the first step ended: it did every admitted request's prefill,
            self._prefix_cache.prefilled()
            for req in self._left_in_prefill:  # those that left the batch meanwhile too
                self._cache_computed(req)
            self._left_in_prefill.clear()
        if run.counted:
            self._advance(steps)
        else:
            self._emit()
        ms = sum(run.costs_ms[run.done : upto])
        run.done = upto
        self._sim_clock += ms / 1000.0
        self._stats["num_steps"] += steps
        self._stats["sim_busy_s"] += ms / 1000.0
        if self._profile is not None:
            self._profile.append(
                {
                    "name": "step" if steps == 1 else f"{steps} steps",
                    "ph": "X",
                    "ts": run.started * 1e6,
                    "dur": (time.perf_counter() - run.started) * 1e6,
                    "pid": self.replica_index,
                    "tid": 0,
                    "args": {"running": len(self._running), "prefill_tokens": run.prefill, "sim_ms": ms},
                }
            )

    def _advance(self, steps: int) -> None:
        """``steps`` steps of a fast-forward: every running sequence counts its tokens and takes
        the KV blocks they fill (free: checked when planned); a sequence ends at its planned end.
        The last step runs sequence by sequence, as one step at a time would: a sequence that ends
        frees its blocks to the prefix cache before the next takes one (which may evict)."""
        running = list(self._running)
        self._stats["generation_tokens"] += steps * len(running)
        if steps > 1:
            for req in running:
                self._take_blocks(req, steps - 1)
        for req in running:
            self._take_blocks(req, 1)
            if len(req.generated) + req.pending >= req.end_at:
                self._materialize(req)
                reason = self._stop_reason(req, req.generated[-1])
                if reason is not None:
                    self._finish(req, reason)

    def _take_blocks(self, req: _Request, steps: int) -> None:
        req.pending += steps
        need = self._blocks_for(req.context_len)
        if need > req.blocks:
            self._kv_blocks_free -= need - req.blocks
            req.blocks = need
            self._evict()

    def _catch_up(self, interrupt: bool = True) -> None:
        """Settle the steps of a fast-forward that ended by now, before something reads or changes
        the batch. ``interrupt``: the batch changes, so the fast-forward stops at the end of the
        step in progress (the loop then plans again)."""
        run = self._run_now
        if run is None or run.planned == 1:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # read from outside the loop (a test, a report): nothing has ended yet
            return
        ended = bisect_left(run.ends, loop.time(), run.done, run.planned)
        self._settle(run, ended)
        if interrupt and ended < run.planned:
            del run.ends[ended + 1 :]
            del run.costs_ms[ended + 1 :]
            if self._wake_at is not None:
                fut, handle = self._wake_at
                handle.cancel()
                self._wake_at = (fut, loop.call_at(run.ends[-1], _wake, fut))

    def _materialize_all(self) -> None:
        for req in self._running:
            self._materialize(req)

    async def _sleep_until(self, when: float) -> None:
        """Sleep until ``when`` on the loop's clock; :meth:`_catch_up` may bring the wake forward."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._wake_at = (fut, loop.call_at(when, _wake, fut))
        try:
            await fut
        finally:
            self._wake_at[1].cancel()
            self._wake_at = None


__all__ = ["StepLoop"]
