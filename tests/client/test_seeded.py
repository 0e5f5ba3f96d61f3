"""A client seeded through ``routing.seed`` makes the same random choices every time: a plan on a
virtual clock repeats exactly only if its clients' backoff jitter repeats, as their routing ties do
(colocate_async plans differed run to run while the jitter was unseeded: its resumes wait out
backoffs while the fleet sleeps)."""

from __future__ import annotations

import pytest

from rollfleet.client import LLMServerClient
from rollfleet.config import RolloutConfig

pytestmark = pytest.mark.unit


def backoffs(seed: int | None) -> list[float]:
    client = LLMServerClient(RolloutConfig.model_validate({"routing": {"seed": seed}}))
    return [client.retry.backoff(attempt) for attempt in range(1, 9)]


def test_a_seeded_client_backs_off_the_same_way_every_time():
    assert backoffs(7) == backoffs(7)
    assert backoffs(7) != backoffs(8)
    assert backoffs(None) != backoffs(None)  # unseeded: each client draws its own


def test_full_determinism_seeds_the_backoff_from_the_rollout_seed():
    def waits(seed: int) -> list[float]:
        config = RolloutConfig.model_validate({"full_determinism": True, "seed": seed})
        return [LLMServerClient(config).retry.backoff(a) for a in range(1, 9)]

    assert waits(3) == waits(3) != waits(4)


async def test_a_long_wait_backs_off_at_the_cap_and_a_zero_backoff_still_yields():
    """The power was taken before the cap: 2.0 ** 1024 overflowed, and a wait for a routable
    replica with a short max_backoff_s reached that many attempts in 51 s (a bare OverflowError).
    A zero backoff did not await at all: the retry loop held the event loop."""
    import asyncio

    from rollfleet.client.retry import RetryPolicy
    from rollfleet.config import RetryConfig

    capped = RetryPolicy(RetryConfig(max_backoff_s=0.05, jitter=0.0))
    assert capped.backoff(5000) == 0.05
    slow = RetryPolicy(RetryConfig(multiplier=1.05, initial_backoff_s=0.01, max_backoff_s=1.0, jitter=0.0))
    assert slow.backoff(200) == 1.0  # a slow multiplier still reaches the cap
    assert RetryPolicy(RetryConfig(multiplier=1e5, jitter=0.0)).backoff(100) == RetryConfig().max_backoff_s
    zero = RetryPolicy(RetryConfig(initial_backoff_s=0.0, jitter=0.0))
    beats = 0

    async def heartbeat() -> None:
        nonlocal beats
        while True:
            beats += 1
            await asyncio.sleep(0)

    task = asyncio.ensure_future(heartbeat())
    await asyncio.sleep(0)
    for attempt in range(1, 4):
        await zero.wait(attempt)
    task.cancel()
    assert beats >= 3
