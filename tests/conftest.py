"""Shared fixtures: one Ray cluster per test session (starting Ray costs ~5 s)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, namespace="rollfleet-tests", log_to_driver=False)
    yield ray
    ray.shutdown()
