"""``rollfleet serve``: starts Ray, the fleet and the gateway, prints the URL, and stops all of it
cleanly on SIGTERM and on Ctrl-C (SIGINT)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

pytestmark = pytest.mark.slow

#: Ray start-up plus a fleet on a busy 2-core machine.
STARTUP_TIMEOUT_S = 180


def _start(tmp_path, name: str) -> tuple[subprocess.Popen, str]:
    config = tmp_path / f"{name}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "rollout": {
                    "name": "sim",
                    "num_replicas": 1,
                    "prompt_length": 128,
                    "max_model_len": 256,
                    "response_length": 16,
                },
                "ray": {"num_cpus": 1},
                "gateway": {"port": 0, "prometheus_file": str(tmp_path / f"{name}-prometheus.yml")},
            }
        )
    )
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "ROLLFLEET_ADMIN_TOKEN": "cli-token"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollfleet.cli.main", "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    seen = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(r"OpenAI base URL: (http://\S+)/v1", line)
        if match:
            return proc, match.group(1)
    proc.kill()
    raise AssertionError("rollfleet serve did not print its URL:\n" + "".join(seen))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_serve_runs_and_stops_cleanly(tmp_path, sig):
    proc, url = _start(tmp_path, sig.name.lower())
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
            resp = http.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
            assert resp.status_code == 200, resp.text
            assert http.get("/admin/status", headers={"Authorization": "Bearer cli-token"}).status_code == 200
        scrape = yaml.safe_load((tmp_path / f"{sig.name.lower()}-prometheus.yml").read_text())
        assert [j["job_name"] for j in scrape["scrape_configs"]] == ["rollfleet-gateway"]
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
        assert rc == 0, proc.stdout.read() if proc.stdout else rc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/v1/models", timeout=2)


def test_a_taken_port_is_refused_before_ray_starts_naming_the_setting(tmp_path):
    import socket

    config = tmp_path / "taken.yaml"
    config.write_text(yaml.safe_dump({"rollout": {"name": "sim", "num_replicas": 1}, "ray": {"num_cpus": 1}}))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        env.pop("RAY_ADDRESS", None)
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "rollfleet.cli.main", "serve", "--config", str(config), "--port", str(port)],
            capture_output=True,
            text=True,
            env=env,
            timeout=STARTUP_TIMEOUT_S,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"'gateway.port': cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "Started a local Ray instance" not in done.stdout + done.stderr
    print(f"refused in {time.monotonic() - started:.1f} s")
