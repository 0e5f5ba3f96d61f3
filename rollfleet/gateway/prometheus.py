"""Prometheus scrape configs for the fleet and the gateway (verl-compatible helpers).

verl's ``update_prometheus_config(config, server_addresses, rollout_name=None)`` overwrites the
file with its own two jobs and swallows every error into a log line. Here the same call:

* **merges**: jobs named ``rollfleet-*`` that this module writes are replaced, every other job
  and the ``global`` section of an existing file are kept (a hand-written Prometheus config with
  node exporters survives a fleet restart);
* writes **atomically** (temporary file in the same folder, fsync, rename), so a Prometheus
  reloading at the wrong moment never reads half a file;
* scrapes only replicas that really serve HTTP: vLLM and SGLang replicas expose ``/metrics`` at
  their ``http://host:port`` address; sim replicas have ``sim://`` pseudo-addresses and are
  skipped (their numbers reach Prometheus through the gateway's ``/metrics``);
* **reports errors**: a file that is not valid YAML, a write that fails, a Prometheus that refuses
  to reload (it needs ``--web.enable-lifecycle``) raise :class:`PrometheusConfigError`.

Single-node: the file is written where this process runs (verl fans the write out to every Ray
node; a multi-node deployment points Prometheus at the gateway host, whose ``/metrics`` covers the
fleet, or runs this on each node).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence
from urllib.parse import urlsplit

import httpx
import yaml

#: Jobs this module owns (and replaces on every update) start with this prefix.
JOB_PREFIX = "rollfleet-"
GATEWAY_JOB = "rollfleet-gateway"

#: Prometheus answers a reload in well under a second; a bound keeps a hung one from blocking us.
RELOAD_TIMEOUT_S = 10.0


class PrometheusConfigError(RuntimeError):
    """Writing the scrape config or reloading Prometheus failed; the message says which and why."""


@dataclass
class PrometheusConfig:
    """Where the scrape config goes and which Prometheus to reload (verl's ``PrometheusConfig`` keys).

    ``port=None`` writes the file without asking any Prometheus to reload.
    """

    file: str
    port: Optional[int] = 9090
    host: str = "127.0.0.1"
    scrape_interval: str = "10s"
    enable: bool = True


def scrape_targets(server_addresses: Iterable[str]) -> dict[str, list[str]]:
    """``{scheme: ["host:port", ...]}`` for the addresses Prometheus can scrape (http/https);
    ``sim://`` and other pseudo-addresses are skipped. A bare ``host:port`` counts as http."""
    out: dict[str, list[str]] = {}
    for address in server_addresses:
        if not address:
            continue
        if "://" not in address:
            address = "http://" + address
        parts = urlsplit(address)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            continue
        target = parts.netloc.rsplit("@", 1)[-1]
        bucket = out.setdefault(parts.scheme, [])
        if target not in bucket:
            bucket.append(target)
    return out


def build_jobs(
    server_addresses: Sequence[str],
    rollout_name: Optional[str] = None,
    *,
    gateway_address: Optional[str] = None,
    scrape_interval: str = "10s",
) -> list[dict[str, Any]]:
    """The ``rollfleet-*`` scrape jobs: one for the replicas (per scheme), one for the gateway."""
    jobs: list[dict[str, Any]] = []
    base = f"{JOB_PREFIX}{rollout_name or 'rollout'}"
    for scheme, targets in sorted(scrape_targets(server_addresses).items()):
        job: dict[str, Any] = {
            "job_name": base if scheme == "http" else f"{base}-{scheme}",
            "scrape_interval": scrape_interval,
            "metrics_path": "/metrics",
            "static_configs": [{"targets": targets, "labels": {"rollout": rollout_name or "rollout"}}],
        }
        if scheme != "http":
            job["scheme"] = scheme
        jobs.append(job)
    if gateway_address:
        targets = scrape_targets([gateway_address]).get("http") or scrape_targets([gateway_address]).get("https")
        if targets:
            jobs.append(
                {
                    "job_name": GATEWAY_JOB,
                    "scrape_interval": scrape_interval,
                    "metrics_path": "/metrics",
                    "static_configs": [{"targets": targets}],
                }
            )
    return jobs


def merge_jobs(existing: Optional[dict[str, Any]], jobs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Replace this module's jobs in ``existing`` (all ``rollfleet-*`` ones), keep everything else."""
    config: dict[str, Any] = dict(existing or {})
    config.setdefault("global", {"scrape_interval": "10s", "evaluation_interval": "10s"})
    kept = [j for j in (config.get("scrape_configs") or []) if not str(j.get("job_name", "")).startswith(JOB_PREFIX)]
    config["scrape_configs"] = kept + [dict(j) for j in jobs]
    return config


def read_config_file(config_path: str) -> Optional[dict[str, Any]]:
    """The existing config, ``None`` when there is none; invalid YAML raises (never overwritten)."""
    path = Path(config_path)
    if not path.exists():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise PrometheusConfigError(f"{config_path} is not valid YAML; not overwriting it: {exc}") from exc
    if data is None:
        return None
    if not isinstance(data, dict):
        raise PrometheusConfigError(f"{config_path} does not hold a Prometheus config (a mapping); not overwriting it")
    return data


def write_config_file(config_data: dict[str, Any], config_path: str) -> str:
    """Write ``config_data`` as YAML to ``config_path`` atomically; return the path."""
    path = Path(config_path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
        try:
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump(config_data, f, default_flow_style=False, sort_keys=False, indent=2)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        raise PrometheusConfigError(f"could not write {config_path}: {exc}") from exc
    return str(path)


def reload_prometheus(port: int, host: str = "127.0.0.1", timeout_s: float = RELOAD_TIMEOUT_S) -> None:
    """``POST /-/reload``; raises when Prometheus is unreachable or refuses (no lifecycle API)."""
    url = f"http://{host}:{port}/-/reload"
    try:
        resp = httpx.post(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise PrometheusConfigError(f"could not reach Prometheus at {url}: {exc!r}") from exc
    if resp.status_code >= 300:
        hint = " (start Prometheus with --web.enable-lifecycle)" if resp.status_code == 403 else ""
        raise PrometheusConfigError(
            f"Prometheus refused the reload at {url}: HTTP {resp.status_code} {resp.text.strip()!r}{hint}"
        )


def update_prometheus_config(
    config: Any,
    server_addresses: Sequence[str],
    rollout_name: Optional[str] = None,
    *,
    gateway_address: Optional[str] = None,
    reload: bool = True,
) -> dict[str, Any]:
    """Merge scrape jobs for ``server_addresses`` (and the gateway) into ``config.file`` and
    reload the Prometheus on ``config.port``. Returns the config written.

    ``config`` is a :class:`PrometheusConfig` or anything with ``file`` and ``port`` attributes
    (verl's ``PrometheusConfig`` works as is).
    """
    if not getattr(config, "file", None):
        raise PrometheusConfigError("no Prometheus config file given (config.file)")
    jobs = build_jobs(
        server_addresses,
        rollout_name,
        gateway_address=gateway_address,
        scrape_interval=getattr(config, "scrape_interval", "10s"),
    )
    merged = merge_jobs(read_config_file(config.file), jobs)
    write_config_file(merged, config.file)
    port = getattr(config, "port", None)
    if reload and port:
        reload_prometheus(port, getattr(config, "host", "127.0.0.1"))
    return merged


__all__ = [
    "PrometheusConfig",
    "PrometheusConfigError",
    "JOB_PREFIX",
    "GATEWAY_JOB",
    "scrape_targets",
    "build_jobs",
    "merge_jobs",
    "read_config_file",
    "write_config_file",
    "reload_prometheus",
    "update_prometheus_config",
]
