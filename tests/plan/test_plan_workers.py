"""A plan's worker processes end with the plan, however the plan ends.

``rollfleet plan --workers 2`` stopped with SIGTERM (``kill``, ``timeout``, a CI runner) died at
once and left both workers computing with no parent: the clean-up ran only on an exception. A
parent killed outright (SIGKILL) cannot clean up at all: its workers now notice and exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc: no psutil needed)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


def _is_worker(pid: int) -> bool:
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_plan_stopped_by_a_signal_leaves_no_worker_running(tmp_path, sig):
    plan = subprocess.Popen(
        [sys.executable, "-m", "rollfleet.cli.main", "plan", "--config", "configs/plan.yaml", "--gpus", "4",
         "--steps", "400", "--seeds", "0,1", "--workers", "2", "--out", str(tmp_path / "out")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline and plan.poll() is None:
            time.sleep(0.2)
            workers = [pid for pid in _children(plan.pid) if _is_worker(pid)]
        assert len(workers) == 2, "the plan's two workers never started"
        time.sleep(1.0)  # running their plans
        plan.send_signal(sig)
        code = plan.wait(timeout=30)
        assert code == (143 if sig == signal.SIGTERM else -signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in workers if _alive(pid)], "workers outlived their plan"
    finally:
        for pid in [*workers, plan.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        plan.wait()
