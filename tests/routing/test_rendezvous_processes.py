"""Rendezvous routing must give the same answer in separate processes (verl's hash() does not)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SCRIPT = """
import json
from rollfleet.routing import GlobalRequestLoadBalancer
lb = GlobalRequestLoadBalancer({f"10.0.0.{i}:8000": None for i in range(5)}, full_determinism=True)
print(json.dumps({f"traj-{i}": lb.acquire_server(f"traj-{i}")[0] for i in range(300)}))
"""


def run(seed: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": seed, "PATH": ""},
    )
    return json.loads(out.stdout)


def test_same_answer_in_two_processes_with_different_hash_seeds():
    a, b = run("1"), run("2")
    assert a == b
    assert len(set(a.values())) == 5  # and it spreads
