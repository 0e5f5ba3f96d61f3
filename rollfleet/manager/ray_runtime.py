"""Starting (or joining) Ray: an embedded cluster on loopback, or an existing cluster.

Embedded (no ``ray.address``): a new single-node cluster whose node IP is 127.0.0.1, so Ray's own
traffic and every listener rollfleet opens (data planes, engines) stay on loopback. A laptop on a
shared network must not expose an unauthenticated cluster. (Ray still binds some of its own gRPC
servers to every interface whatever the node IP; see the README's security notes.)

Joining (``ray.address``: ``auto``, ``host:port`` or ``ray://...``): the rollfleet package is
shipped to every node through the job's ``runtime_env`` (``py_modules``), so worker nodes need
nothing installed but Ray and the engine; listeners bind to each node's own IP.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from rollfleet.config import RayConfig

logger = logging.getLogger(__name__)

#: Makes Ray take 127.0.0.1 as the node IP of a local cluster (read by Ray's ``services``).
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def use_loopback() -> None:
    """Make the next local Ray cluster (and the processes it starts) live on 127.0.0.1."""
    os.environ[LOOPBACK_ENV] = "0"
    try:  # the constant is read when Ray is imported: set it too in case Ray already was
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    except Exception:  # pragma: no cover - private constant moved
        logger.debug("could not switch Ray's local-cluster constant", exc_info=True)


def job_runtime_env(config: RayConfig) -> dict[str, Any]:
    """The runtime_env of a job joining a cluster: the user's, plus this package for every node."""
    env = dict(config.runtime_env)
    if config.ship_package:
        import rollfleet

        package = str(Path(rollfleet.__file__).parent)
        modules = list(env.get("py_modules") or [])
        if package not in modules:
            modules.append(package)
        env["py_modules"] = modules
    return env


def ensure_ray(config: RayConfig) -> bool:
    """Initialise Ray if needed; return True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {
        "namespace": config.namespace,
        "include_dashboard": config.include_dashboard,
        "log_to_driver": os.environ.get("ROLLFLEET_RAY_LOG_TO_DRIVER", "0") == "1",
        "configure_logging": False,
    }
    if config.address:
        sized = [k for k in ("num_cpus", "num_gpus") if getattr(config, k) is not None]
        if sized:  # a joined cluster's resources are its nodes' (Ray refuses them with an address)
            logger.warning("ray.%s sizes an embedded cluster only: not used when joining ray.address", sized[0])
        ray.init(address=config.address, runtime_env=job_runtime_env(config) or None, **kwargs)
        logger.info("joined the Ray cluster at %s", config.address)
    else:
        # A new cluster of our own ("local": never silently join one started elsewhere). Replicas
        # reserve devices through placement groups (rollout.placement); num_cpus is logical.
        use_loopback()
        if config.include_dashboard:
            kwargs["dashboard_host"] = "127.0.0.1"
        ray.init(
            address="local",
            num_cpus=config.num_cpus or os.cpu_count() or 1,
            num_gpus=config.num_gpus,
            runtime_env=config.runtime_env or None,
            **kwargs,
        )
        logger.info("started an embedded Ray cluster on 127.0.0.1")
    return True
