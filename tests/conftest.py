"""Shared fixtures: one Ray cluster per test session (starting Ray costs ~5 s)."""

from __future__ import annotations

import os

import pytest
from ray_support import start_session_ray

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# The session's cluster lives on loopback, as an embedded fleet's does (node IP 127.0.0.1).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        start_session_ray()
    yield ray
    ray.shutdown()


#: Every test belongs to a tier (see pyproject.toml's markers): make test-fast runs the unit tier.
TIERS = frozenset({"unit", "ray", "vllm", "slow", "cluster"})


def pytest_collection_modifyitems(config, items):
    untiered = [item.nodeid for item in items if not TIERS & {m.name for m in item.iter_markers()}]
    if untiered:
        raise pytest.UsageError(f"tests without a tier marker ({sorted(TIERS)}): {untiered}")
