"""The built-in task streams: the ``synthetic`` prompts a plan runs on are the ones its seed names."""

from __future__ import annotations

import random

import pytest

from rollfleet.trainer.tasks import TaskStream, randranges

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "low,high,count",
    [
        (16, 1_000, 256),
        (16, 1_000, 1),
        (0, 1, 9),
        (5, 7, 2_000),
        (-10, 10, 77),
        (0, 2**32, 40),
        (0, 2**40, 5),
        (3, 9, 0),
    ],
)
def test_randranges_draws_what_randrange_draws(low, high, count):
    for seed in range(20):
        fast, slow = random.Random(f"s{seed}"), random.Random(f"s{seed}")
        assert randranges(fast, low, high, count) == [slow.randrange(low, high) for _ in range(count)]


def test_a_synthetic_prompt_is_prompt_tokens_ids_fixed_by_name_seed_and_index():
    stream = TaskStream("synthetic", seed=3, prompt_tokens=300)
    first = stream.sample_at(7)
    assert first == stream.sample_at(7)
    assert len(first["prompt_ids"]) == 300 and all(16 <= t < 1_000 for t in first["prompt_ids"])
    rng = random.Random("synthetic:3:7")
    assert first["prompt_ids"] == [rng.randrange(16, 1_000) for _ in range(300)]
    assert first["prompt_ids"] != stream.sample_at(8)["prompt_ids"]
