"""``gather_or_cancel``: concurrent calls that stand or fall together, leaving nothing running."""

from __future__ import annotations

import asyncio

import pytest

from rollfleet.utils.aio import gather_or_cancel

pytestmark = pytest.mark.unit


async def _call(running: set[int], k: int, fail_after: float | None = None) -> int:
    running.add(k)
    try:
        if fail_after is not None:
            await asyncio.sleep(fail_after)
            raise ValueError(f"call {k} failed")
        await asyncio.sleep(0.01 * k)
        return k
    finally:
        running.discard(k)


async def test_results_come_in_call_order():
    running: set[int] = set()
    assert await gather_or_cancel(_call(running, k) for k in (3, 1, 2)) == [3, 1, 2]


async def test_a_failure_cancels_the_other_calls_before_it_is_raised():
    running: set[int] = set()
    calls = [_call(running, 0, fail_after=0.01), *(_call(running, 100 + k) for k in range(3))]
    with pytest.raises(ValueError, match="call 0 failed"):
        await gather_or_cancel(calls)
    assert not running  # asyncio.gather alone leaves the three others sleeping


async def test_cancelling_the_caller_cancels_every_call():
    running: set[int] = set()
    outer = asyncio.ensure_future(gather_or_cancel(_call(running, 100 + k) for k in range(3)))
    await asyncio.sleep(0.01)
    assert len(running) == 3
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert not running


async def test_calls_already_started_are_cancelled_when_building_the_next_one_fails():
    ran: list[int] = []

    async def work(i: int) -> None:
        await asyncio.sleep(0.05)
        ran.append(i)

    def calls():
        for i in range(3):
            if i == 2:
                raise ValueError("building call 2 failed")
            yield work(i)

    with pytest.raises(ValueError, match="call 2"):
        await gather_or_cancel(calls())
    await asyncio.sleep(0.1)
    assert ran == []  # the two started before it ran on, unseen
