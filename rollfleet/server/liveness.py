"""How a replica answers the controller's liveness probe when its engine is slow to answer.

The probe (``Replica.load``) must come back well within ``health.probe_timeout_s``: a probe that
times out counts as a failure, and ``failures_to_dead`` of them in a row kill a replica that may
only be starved of CPU while it generates (2 cores, 32 long generations, a weight update: its
server answers ``/metrics`` and ``/health`` seconds late). So the probe asks the engine for its
load, then for its health, each within a share of the budget, and when neither answers in time it
reports the last known load as long as the engine answered anything within ``health.busy_grace_s``.
A dead engine process is seen at once (the engine's own check); a hung one (SIGSTOP, a deadlock)
stops answering and is reported unhealthy after that silence.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from rollfleet.engines.base import Engine, EngineLoad
from rollfleet.errors import ReplicaUnavailable
from rollfleet.utils.virtual_time import now

#: Most a load poll may take before the health check runs instead (capped by the budget).
ENGINE_LOAD_TIMEOUT_S = 1.5
#: Share of ``health.probe_timeout_s`` the whole answer may take (the rest: Ray's call, a busy loop).
PROBE_BUDGET_SHARE = 0.6


class EngineLiveness:
    """The engine's last load and when it last answered anything."""

    def __init__(self, replica_id: str, engine: Engine, probe_timeout_s: float, busy_grace_s: float) -> None:
        self.replica_id = replica_id
        self.engine = engine
        self.budget_s = PROBE_BUDGET_SHARE * probe_timeout_s
        self.busy_grace_s = busy_grace_s
        self.load = EngineLoad()
        self.answered_at: Optional[float] = None  # set by the first poll, on the loop's clock

    async def poll(self) -> EngineLoad:
        """The engine's load now, or the last one while it is busy; raises
        :class:`ReplicaUnavailable` when it is unhealthy or has been silent too long."""
        # The loop's clock: virtual on a simulated fleet, where a hung engine must be found out too
        # (the host's clock hardly moves there, and no silence ever reached busy_grace_s).
        started = now()
        if self.answered_at is None:
            self.answered_at = started
        load_wait = min(ENGINE_LOAD_TIMEOUT_S, self.budget_s / 2)
        try:
            self.load = await asyncio.wait_for(self.engine.load(), load_wait)
            self.answered_at = now()
            return self.load
        except asyncio.TimeoutError:
            pass
        remaining = max(0.1, self.budget_s - (now() - started))
        try:
            health = await asyncio.wait_for(self.engine.health(), remaining)
        except asyncio.TimeoutError:
            silent = now() - self.answered_at
            if silent > self.busy_grace_s:
                raise ReplicaUnavailable(
                    self.replica_id, f"engine silent for {silent:.0f}s (no load, no health)"
                ) from None
            return self.load  # starved, not dead: it answered within busy_grace_s
        if not health.healthy:
            raise ReplicaUnavailable(self.replica_id, f"engine unhealthy: {health.detail}")
        self.answered_at = now()
        return self.load


__all__ = ["EngineLiveness", "ENGINE_LOAD_TIMEOUT_S", "PROBE_BUDGET_SHARE"]
