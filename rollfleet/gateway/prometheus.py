"""Re-export of :mod:`rollfleet.manager.prometheus`, where the scrape-config helpers now live.

The fleet controller (manager layer, below the gateway) writes and refreshes the scrape config, so
the code moved down; ``from rollfleet.gateway.prometheus import ...`` keeps working for callers of
the gateway's helpers (``rollfleet serve`` adds the gateway's own job with them).
"""

from __future__ import annotations

from rollfleet.manager.prometheus import (
    GATEWAY_JOB,
    JOB_PREFIX,
    RELOAD_TIMEOUT_S,
    PrometheusConfig,
    PrometheusConfigError,
    build_jobs,
    merge_jobs,
    read_config_file,
    reload_prometheus,
    scrape_targets,
    update_prometheus_config,
    write_config_file,
)

__all__ = [
    "PrometheusConfig",
    "PrometheusConfigError",
    "JOB_PREFIX",
    "GATEWAY_JOB",
    "RELOAD_TIMEOUT_S",
    "scrape_targets",
    "build_jobs",
    "merge_jobs",
    "read_config_file",
    "write_config_file",
    "reload_prometheus",
    "update_prometheus_config",
]
