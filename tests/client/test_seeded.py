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
