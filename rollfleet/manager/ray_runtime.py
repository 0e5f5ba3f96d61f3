"""Starting (or joining) Ray: an embedded local cluster when no address is configured."""

from __future__ import annotations

import logging
import os

from rollfleet.config import RayConfig

logger = logging.getLogger(__name__)


def ensure_ray(config: RayConfig) -> bool:
    """Initialise Ray if needed; return True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    kwargs = {
        "namespace": config.namespace,
        "include_dashboard": config.include_dashboard,
        "log_to_driver": os.environ.get("ROLLFLEET_RAY_LOG_TO_DRIVER", "0") == "1",
        "configure_logging": False,
    }
    if config.address:
        ray.init(address=config.address, **kwargs)
    else:
        # An embedded single-machine cluster. Replicas take no CPU slots (their engines run their
        # own threads or processes); num_cpus only bounds Ray tasks the user adds.
        ray.init(num_cpus=config.num_cpus or os.cpu_count() or 1, **kwargs)
        logger.info("started an embedded Ray cluster")
    return True
