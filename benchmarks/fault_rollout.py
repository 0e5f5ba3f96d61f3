"""The measuring half of ``benchmarks/faults.py``: a rollout that a fault is injected into, and what
it counts (lost, duplicated, truncated, in flight after, time to detect and recover, fleet-frozen
time); the scenarios and the command line are in ``faults.py``."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.config import RollfleetConfig
from rollfleet.manager import LLMServerManager

#: The replica a single-replica fault hits.
VICTIM = "replica-1"


@dataclass
class Outcome:
    scenario: str
    requests: int = 0
    lost: int = 0
    duplicated: int = 0
    truncated: int = 0
    inflight_left: int = 0
    detect_s: Optional[float] = None
    recover_s: Optional[float] = None
    update_s: Optional[float] = None
    frozen_s: float = 0.0
    wall_s: float = 0.0
    updates: int = 0
    cancelled: int = 0
    victims: int = 0  # replicas the fault hit


def fleet_config(args: argparse.Namespace, **rollout: Any) -> RollfleetConfig:
    """The sim fleet of every scenario; ``rollout`` keys replace its sections."""
    defaults = {
        "name": "sim",
        "num_replicas": 4,
        "prompt_length": 256,
        "response_length": args.budget,
        "max_model_len": 4096,
        "retry": {"max_attempts": 8, "initial_backoff_s": 0.02, "max_backoff_s": 0.5},
        "health": {
            "probe_interval_s": 0.5,
            "probe_timeout_s": 2.0,
            "failures_to_dead": 2,
            "busy_grace_s": 3.0,
            "control_timeout_s": 5.0,
            "restart_backoff_s": 0.5,
        },
        "weight_sync": {"mode": "keep", "commit_timeout_s": 5.0, "stage_timeout_s": 5.0},
        "sim": {"time_scale": args.time_scale, "vocab_size": 2000},
    }
    return RollfleetConfig.model_validate({"rollout": defaults | rollout})


async def watch_victims(
    manager: LLMServerManager, victims: list[str], since: float, out: Outcome, stop: asyncio.Event
) -> None:
    """Times from the fault to the first victim marked dead (detect) and until every victim is
    healthy again (recover)."""
    while not stop.is_set():
        states = [(await manager.status()).replicas[v].state for v in victims]
        now = time.monotonic() - since
        if out.detect_s is None and any(state not in ("healthy", "suspect") for state in states):
            out.detect_s = now
        elif out.detect_s is not None and out.recover_s is None and all(state == "healthy" for state in states):
            out.recover_s = now
            return
        await asyncio.sleep(0.05)


async def rollout(
    manager: LLMServerManager,
    args: argparse.Namespace,
    name: str,
    fault: Optional[Callable[[Outcome, float], Awaitable[Optional[asyncio.Task[None]]]]],
    watch: bool = True,
    victims: tuple[str, ...] = (VICTIM,),
) -> Outcome:
    """``args.requests`` generations, ``args.concurrency`` at a time (each worker starts the next as
    one finishes, so generations finish all along the run), budgets drawn from [budget/4, budget];
    ``fault`` is injected ``args.fault_at`` seconds in."""
    out = Outcome(name, requests=args.requests)
    client = manager.get_client(FullyAsyncLLMServerClient)
    rng = random.Random(7)
    budgets = [rng.randint(args.budget // 4, args.budget) for _ in range(args.requests)]
    queue = list(range(args.requests))
    finished: list[float] = []

    async def worker() -> None:
        while queue:
            i = queue.pop()
            try:
                o = await client.generate(
                    f"{name}-{i}",
                    prompt_ids=[3, 4, 5 + i % 1000],
                    sampling_params={"max_tokens": budgets[i], "ignore_eos": True},
                )
            except Exception:
                out.lost += 1
                continue
            n = len(o.token_ids)
            out.duplicated += n > budgets[i]
            out.truncated += n < budgets[i]
            finished.append(time.monotonic())

    started = time.monotonic()
    workers = asyncio.ensure_future(asyncio.gather(*(worker() for _ in range(args.concurrency))))
    stop = asyncio.Event()
    watcher = background = None
    if fault is not None:
        await asyncio.sleep(args.fault_at)
        fault_at = time.monotonic()
        if watch:
            out.victims = len(victims)
            watcher = asyncio.ensure_future(watch_victims(manager, list(victims), fault_at, out, stop))
        background = await fault(out, fault_at)
    await workers
    out.wall_s = time.monotonic() - started
    if background is not None:
        background.cancel()
    if watcher is not None:
        try:
            await asyncio.wait_for(watcher, 120)
        except asyncio.TimeoutError:
            pass
    stop.set()
    stamps = sorted(finished)  # from the first completion on: the ramp-up is not a freeze
    out.frozen_s = max((b - a for a, b in zip(stamps, stamps[1:])), default=0.0)
    out.inflight_left = client.balancer.get_total_inflight()
    return out
