"""How the test session starts its Ray cluster (shared by tests/conftest.py and tests/manager/cluster)."""

from __future__ import annotations


def start_session_ray() -> None:
    """The session's single-node cluster on loopback (tests/manager/cluster stops it for a multi-node one,
    then calls this again)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="rollfleet-tests", log_to_driver=False)
