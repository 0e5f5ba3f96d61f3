"""VirtualFleet: simulated replicas and the client that routes to them, in one process.

Built from the same parts as a fleet on Ray, minus Ray: a plain :class:`~rollfleet.server.Replica`
per replica (validation, version stamps, load reports) around a
:class:`~rollfleet.engines.sim.SimEngine`, reached through
:class:`~rollfleet.server.local.LocalHandle`, and the client the agent loops use
(``FullyAsyncLLMServerClient`` by default: balancer, routing policy, stickiness, resumes). Run
inside :func:`rollfleet.utils.virtual_time.run`, every engine step costs its simulated time and no
wall time, so what a workload reports (makespan, busy time, prefix hits) depends on the model and
the routing only: the same on any host, under any load.

Weight updates go through the replicas' two-phase path (stage, then commit in ``abort`` or
``keep`` mode; ``rolling`` in waves of ``max_unavailable`` of the fleet), as the fleet controller
drives them.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from rollfleet.client import FullyAsyncLLMServerClient, LLMServerClient
from rollfleet.config import RollfleetConfig, RolloutConfig
from rollfleet.engines.base import CommitMode
from rollfleet.server.local import LocalHandle
from rollfleet.server.replica import Replica


@dataclass
class FleetReport:
    """What a run cost the fleet, from the engines' own counters (simulated seconds)."""

    makespan_s: float
    busy_s: dict[str, float] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0  # prompt tokens of every admission, cached or not
    prefill_tokens: int = 0  # of which computed (not found in the prefix cache)
    output_tokens: int = 0
    preempted: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return 1.0 - self.prefill_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def busy_imbalance(self) -> float:
        """Busiest replica's busy time over the mean (1.0: perfectly even)."""
        busy = list(self.busy_s.values())
        mean = sum(busy) / len(busy) if busy else 0.0
        return max(busy) / mean if mean else 1.0


class VirtualFleet:
    """``rollout.num_replicas`` sim replicas and a client; use inside a running event loop."""

    def __init__(self, rollout: RolloutConfig, client_cls: type[LLMServerClient] = FullyAsyncLLMServerClient) -> None:
        if rollout.name != "sim":
            raise ValueError(f"rollout.name must be 'sim' for a virtual fleet, got {rollout.name!r}")
        if rollout.sim.time_scale != 1.0:
            # A virtual clock needs no pacing, and its seconds are the simulated ones: scaled, the
            # engines' steps took 1/time_scale of the clock while their busy time stayed unscaled.
            rollout = rollout.model_copy(update={"sim": rollout.sim.model_copy(update={"time_scale": 1.0})})
        self.rollout = rollout
        self.replicas = {f"replica-{i}": Replica(f"replica-{i}", rollout, i) for i in range(rollout.num_replicas)}
        self.client = client_cls(rollout, servers=self._handles())
        self._clients: list[LLMServerClient] = []
        self.version = 0
        self._started_at: Optional[float] = None

    @classmethod
    async def create(cls, config: RollfleetConfig) -> "VirtualFleet":
        """Build and start a fleet from a whole config (what ``LLMServerManager.create`` takes)."""
        return await cls(config.rollout).start()

    async def start(self) -> "VirtualFleet":
        await asyncio.gather(*(r.start(version=self.version) for r in self.replicas.values()))
        self._started_at = asyncio.get_running_loop().time()
        return self

    def get_client(self, client_cls: Optional[type[LLMServerClient]] = None, **kwargs: Any) -> LLMServerClient:
        """A client of this fleet, as ``LLMServerManager.get_client`` hands one out: the fleet's
        own when it is already a ``client_cls`` and no settings are given, else a new one of
        ``client_cls`` (constructor arguments in ``kwargs``) on the same replicas, closed with the
        fleet."""
        if client_cls is None or (isinstance(self.client, client_cls) and not kwargs):
            return self.client
        if not (isinstance(client_cls, type) and issubclass(client_cls, LLMServerClient)):
            raise TypeError(f"client_cls must be a subclass of LLMServerClient, got {client_cls!r}")
        client = client_cls(self.rollout, servers=self._handles(), **kwargs)
        self._clients.append(client)
        return client

    def _handles(self) -> dict[str, LocalHandle]:
        """What a client routes to: each replica, called in this process."""
        return {rid: LocalHandle(r) for rid, r in self.replicas.items()}

    async def learner_placement(self) -> None:
        """A virtual fleet reserves no devices: the learner is wherever the caller runs it."""
        return None

    async def pause(self) -> None:
        await asyncio.gather(*(r.pause() for r in self.replicas.values()))

    async def resume(self) -> None:
        await asyncio.gather(*(r.resume() for r in self.replicas.values()))

    async def sleep(self) -> None:
        await asyncio.gather(*(r.sleep() for r in self.replicas.values()))

    async def wake_up(self) -> None:
        await asyncio.gather(*(r.wake_up() for r in self.replicas.values()))

    async def update_weights(
        self, weights: Any = None, version: Optional[int] = None, mode: Optional[str] = None
    ) -> dict[str, Any]:
        """Stage ``version`` (default: the next one) on every replica while they serve, then commit
        it (``mode``: ``rollout.weight_sync.mode`` by default): everywhere at once, or ``rolling``
        in waves of ``max_unavailable`` of the fleet (at least one replica), each committing as
        ``keep`` while the others generate, as the controller does (its clients' preference for
        the new version's replicas for new work is not modelled: they route by load alone).
        Returns the version, how long it took and when the replicas were committing
        (``paused``: ``[start, end]`` of each wave; ``pause_s``, the longest), in simulated
        seconds, as the manager's result does."""
        clock = asyncio.get_running_loop().time
        started = clock()
        version = self.version + 1 if version is None else version
        sync = self.rollout.weight_sync
        mode = mode or sync.mode
        if mode not in ("abort", "keep", "rolling"):
            raise ValueError(f"weight_sync.mode must be abort, keep or rolling, got {mode!r}")
        commit_mode: CommitMode = "abort" if mode == "abort" else "keep"
        payload = {"version": version} if weights is None else weights
        await asyncio.gather(*(r.stage_weights(payload, version) for r in self.replicas.values()))
        replicas = list(self.replicas.values())
        wave = len(replicas) if mode != "rolling" else max(1, math.floor(sync.max_unavailable * len(replicas)))
        paused: list[list[float]] = []
        for i in range(0, len(replicas), max(1, wave)):
            committing = clock()
            await asyncio.gather(*(r.commit_weights(version, commit_mode) for r in replicas[i : i + wave]))
            paused.append([committing, clock()])
        self.version = version
        done = clock()
        return {
            "version": version,
            "mode": mode,
            "total_s": done - started,
            "pause_s": max((end - start for start, end in paused), default=0.0),  # staging went on meanwhile
            "paused": paused,
            "waves": len(paused),
        }

    async def replica_stats(self) -> dict[str, dict[str, Any]]:
        return {rid: await r.stats() for rid, r in self.replicas.items()}

    async def report(self) -> FleetReport:
        assert self._started_at is not None, "start() first"
        out = FleetReport(makespan_s=asyncio.get_running_loop().time() - self._started_at)
        for rid, stats in (await self.replica_stats()).items():
            out.busy_s[rid] = float(stats["sim_busy_s"])
            out.requests[rid] = int(stats["requests"])
            out.prompt_tokens += int(stats["prefix_cache_query_tokens"])
            out.prefill_tokens += int(stats["prefix_cache_query_tokens"] - stats["prefix_cache_hit_tokens"])
            out.output_tokens += int(stats["tokens_out"])
            out.preempted += int(stats["num_preemptions"])
        return out

    async def shutdown(self) -> None:
        await asyncio.gather(*(c.close() for c in [self.client, *self._clients]))
        await asyncio.gather(*(r.shutdown() for r in self.replicas.values()))


__all__ = ["VirtualFleet", "FleetReport"]
