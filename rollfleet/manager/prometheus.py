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

The fleet controller keeps the file current with :class:`ScrapeConfigWriter`: at launch, on
add/remove of replicas and after a restart moves a replica to a new port or node. It rewrites only
when the set of targets changed, replaces only its own replica jobs (the ``rollfleet-gateway`` job
that ``rollfleet serve`` adds survives), and logs its errors instead of raising them: monitoring
must not stop the fleet.

Single-node: the controller writes the file on the node where it runs, which the manager pins to
the driver's node (verl fans the write out to every Ray node; a multi-node deployment runs
Prometheus on the driver's node, or points it at the gateway host, whose ``/metrics`` covers the
fleet).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence
from urllib.parse import urlsplit

import httpx
import yaml

from rollfleet.config import PrometheusSection

logger = logging.getLogger(__name__)

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


def replica_job_name(rollout_name: Optional[str], scheme: str = "http") -> str:
    """Name of the replica job for one scheme: ``rollfleet-<rollout>`` (``-https`` for https)."""
    base = f"{JOB_PREFIX}{rollout_name or 'rollout'}"
    return base if scheme == "http" else f"{base}-{scheme}"


def build_jobs(
    server_addresses: Sequence[str],
    rollout_name: Optional[str] = None,
    *,
    gateway_address: Optional[str] = None,
    scrape_interval: str = "10s",
) -> list[dict[str, Any]]:
    """The ``rollfleet-*`` scrape jobs: one for the replicas (per scheme), one for the gateway."""
    jobs: list[dict[str, Any]] = []
    for scheme, targets in sorted(scrape_targets(server_addresses).items()):
        job: dict[str, Any] = {
            "job_name": replica_job_name(rollout_name, scheme),
            "scrape_interval": scrape_interval,
            "metrics_path": "/metrics",
            "static_configs": [{"targets": targets, "labels": {"rollout": rollout_name or "rollout"}}],
        }
        if scheme != "http":
            job["scheme"] = scheme
        jobs.append(job)
    if gateway_address:
        for scheme, gateway_targets in sorted(scrape_targets([gateway_address]).items()):
            gateway_job: dict[str, Any] = {
                "job_name": GATEWAY_JOB,
                "scrape_interval": scrape_interval,
                "metrics_path": "/metrics",
                "static_configs": [{"targets": gateway_targets}],
            }
            if scheme != "http":  # scraped over plain http, a TLS port answers nothing
                gateway_job["scheme"] = scheme
            jobs.append(gateway_job)
    return jobs


def merge_jobs(
    existing: Optional[dict[str, Any]],
    jobs: Sequence[dict[str, Any]],
    *,
    owns: Optional[Callable[[str], bool]] = None,
) -> dict[str, Any]:
    """Replace this module's jobs in ``existing``, keep everything else. ``owns(job_name)`` says
    which jobs are replaced; by default all ``rollfleet-*`` ones."""
    owned = owns or (lambda name: name.startswith(JOB_PREFIX))
    config: dict[str, Any] = dict(existing or {})
    config.setdefault("global", {"scrape_interval": "10s", "evaluation_interval": "10s"})
    kept = [j for j in (config.get("scrape_configs") or []) if not owned(str(j.get("job_name", "")))]
    config["scrape_configs"] = kept + [dict(j) for j in jobs]
    return config


def read_config_file(config_path: str) -> Optional[dict[str, Any]]:
    """The existing config, ``None`` when there is none; invalid YAML raises (never overwritten)."""
    path = Path(config_path)
    if not path.exists():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise PrometheusConfigError(f"could not read {config_path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise PrometheusConfigError(f"{config_path} is not valid YAML; not overwriting it: {exc}") from exc
    if data is None:
        return None
    if not isinstance(data, dict):
        raise PrometheusConfigError(f"{config_path} does not hold a Prometheus config (a mapping); not overwriting it")
    jobs = data.get("scrape_configs")
    if jobs is not None and not (isinstance(jobs, list) and all(isinstance(j, dict) for j in jobs)):
        # merged job by job: anything else was a bare AttributeError in a task nobody awaited
        raise PrometheusConfigError(
            f"{config_path}: scrape_configs is not a list of jobs (mappings); not overwriting it"
        )
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


class ScrapeConfigWriter:
    """Keeps the scrape config in step with the fleet; the controller calls :meth:`refresh` with
    the replicas' addresses after every change of membership or address.

    A refresh writes (in a worker thread) only when the set of targets differs from the last one
    written, then asks the Prometheus on ``config.port`` to reload. Refreshes are serialised and
    each writes the newest address list handed in, so a slow refresh never overwrites a newer one.
    Only the replica jobs of ``rollout_name`` are replaced: the gateway's job and hand-written jobs
    in the same file stay. Failures are logged and kept in :attr:`last_error` (``None`` after a
    refresh that succeeded), never raised; a failed write or reload is retried by the next refresh.
    With ``config.enable`` false, a refresh does nothing.
    """

    def __init__(self, config: PrometheusSection, rollout_name: Optional[str] = None) -> None:
        self.config = config
        self.rollout_name = rollout_name
        self.last_error: Optional[PrometheusConfigError] = None
        #: Files written so far (for tests and status pages).
        self.writes = 0
        self._owned = {replica_job_name(rollout_name, scheme) for scheme in ("http", "https")}
        self._written: Optional[frozenset[tuple[str, str]]] = None
        self._reload_pending = False
        self._newest: list[str] = []
        self._lock = asyncio.Lock()

    async def refresh(self, addresses: Sequence[str]) -> bool:
        """Write the scrape config for ``addresses`` if its targets changed; True when it wrote."""
        if not self.config.enable or not self.config.file:
            return False
        self._newest = list(addresses)
        async with self._lock:
            addresses = self._newest  # a refresh queued behind a newer one writes the newer list
            targets = frozenset((s, t) for s, ts in scrape_targets(addresses).items() for t in ts)
            wrote = False
            try:
                if targets != self._written:
                    await asyncio.to_thread(self._write, addresses)
                    self._written, wrote = targets, True
                    self.writes += 1
                    self._reload_pending = self.config.port is not None
                if self._reload_pending:
                    assert self.config.port is not None  # a reload is only ever pending with a port
                    await asyncio.to_thread(reload_prometheus, self.config.port, self.config.host)
                    self._reload_pending = False
                self.last_error = None
            except PrometheusConfigError as exc:
                self.last_error = exc
                logger.warning("prometheus scrape config not updated (the fleet carries on): %s", exc)
            return wrote

    def _write(self, addresses: Sequence[str]) -> None:
        file = self.config.file
        assert file
        jobs = build_jobs(addresses, self.rollout_name, scrape_interval=self.config.scrape_interval)
        merged = merge_jobs(read_config_file(file), jobs, owns=self._owned.__contains__)
        write_config_file(merged, file)


__all__ = [
    "ScrapeConfigWriter",
    "PrometheusConfig",
    "PrometheusConfigError",
    "JOB_PREFIX",
    "GATEWAY_JOB",
    "scrape_targets",
    "replica_job_name",
    "build_jobs",
    "merge_jobs",
    "read_config_file",
    "write_config_file",
    "reload_prometheus",
    "update_prometheus_config",
]
