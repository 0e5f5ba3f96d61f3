"""An embedded fleet lives on loopback: Ray's node IP is 127.0.0.1 and no listener that rollfleet
opens (gateway, replicas' data planes, the controller and replica processes) is bound to any other
address. Run through ``rollfleet serve`` as a user would, then every listening socket of the
process tree is listed. Ray's own daemons (GCS, raylet, agents) are listed apart: Ray binds some
of its gRPC servers to every interface whatever the node IP (see the README's security notes).
"""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import sys
import time

import psutil
import pytest
import yaml

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 180
#: Processes that are Ray's own, not rollfleet's (matched on the command line).
RAY_DAEMONS = (
    "gcs_server",
    "raylet",
    "dashboard/agent.py",
    "log_monitor.py",
    "runtime_env/agent",
    "monitor.py",
    "dashboard/dashboard.py",
    "ray_client_server",
)


def is_loopback(host: str) -> bool:
    host = host.removeprefix("::ffff:")
    return ipaddress.ip_address(host).is_loopback


def listeners(proc: psutil.Process) -> list[tuple[str, int]]:
    try:
        return [(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def test_an_embedded_fleet_listens_on_loopback_only(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "rollout": {
                    "name": "sim",
                    "num_replicas": 2,
                    "prompt_length": 128,
                    "max_model_len": 256,
                    "response_length": 16,
                },
                "ray": {"num_cpus": 2},
                "gateway": {"port": 0},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["RAY_AUTH_MODE"] = "disabled"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollfleet.cli.main", "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        url = None
        assert proc.stdout is not None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "rollfleet serve exited before printing its URL"
            found = re.search(r"http://[\d.]+:\d+", line)
            url = found.group(0) if found else None
        assert url and url.startswith("http://127.0.0.1:")
        tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
        ours, rays = {}, {}
        for p in tree:
            cmd = " ".join(p.cmdline())
            bucket = rays if any(d in cmd for d in RAY_DAEMONS) else ours
            bucket[(p.pid, cmd[:80])] = listeners(p)
        raylet = next(cmd for (_, cmd) in rays if "raylet" in cmd)
        raylet_cmd = " ".join(next(p.cmdline() for p in tree if "raylet" in " ".join(p.cmdline())))
        assert "--node_ip_address=127.0.0.1" in raylet_cmd, raylet
        opened = [addr for addrs in ours.values() for addr in addrs]
        # The gateway, two data planes, and Ray's core-worker servers of our processes at least.
        assert len(opened) >= 3, ours
        wide = {k: v for k, v in ours.items() if any(not is_loopback(ip) for ip, _ in v)}
        assert not wide, f"rollfleet processes listening beyond loopback: {wide}"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
