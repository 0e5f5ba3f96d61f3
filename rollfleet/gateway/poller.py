"""Background polling of the fleet's control plane for ``/metrics`` and ``/admin/status``.

Health states, weight versions and replica statistics come from the manager (the controller
actor), which is the control plane: asking it per request would put a round trip to one actor on
the data path, the very bottleneck rollfleet exists to remove. So a task asks every
``status_poll_interval_s`` and keeps the last answer; a failed poll keeps the previous one and is
counted, never raised into a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional, Protocol

from rollfleet.records import FleetStatus

logger = logging.getLogger(__name__)


class AdminBackend(Protocol):
    """The control-plane operations the gateway uses; :class:`LLMServerManager` has them all."""

    def status(self) -> Any: ...  # awaitable of FleetStatus
    def replica_stats(self) -> Any: ...
    def get_replicas(self) -> Any: ...  # awaitable of list[ReplicaInfo]
    def add_replicas(self, n: int) -> Any: ...  # awaitable of list[ReplicaInfo]
    def remove_replicas(self, replica_ids: list[str], drain_timeout_s: float = 30.0) -> Any: ...
    def update_weights(self, weights: Any, version: int, mode: Optional[str] = None) -> Any: ...
    def start_profile(self, **kwargs: Any) -> Any: ...
    def stop_profile(self) -> Any: ...


class FleetStatusPoller:
    """Keeps the latest ``status()`` and ``replica_stats()`` of the fleet."""

    def __init__(self, backend: AdminBackend, interval_s: float = 2.0, timeout_s: float = 10.0) -> None:
        self.backend = backend
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.status: Optional[FleetStatus] = None
        self.stats: Optional[dict[str, Any]] = None
        self.updated_at: Optional[float] = None
        self.errors = 0
        self._task: Optional[asyncio.Task[None]] = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="rollfleet-gateway-poller")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    async def poll_once(self) -> None:
        status, stats = await asyncio.wait_for(
            asyncio.gather(self.backend.status(), self.backend.replica_stats()), self.timeout_s
        )
        # The gateway reports its own client itself.
        self.status, self.stats = status.model_copy(update={"clients": []}), stats
        self.updated_at = time.monotonic()

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the controller may be busy or restarting; keep the last view
                self.errors += 1
                logger.debug("fleet status poll failed: %r", exc)
            await asyncio.sleep(self.interval_s)


__all__ = ["AdminBackend", "FleetStatusPoller"]
