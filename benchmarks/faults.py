"""Faults while a fleet generates: what is lost, duplicated or truncated, and how long it takes to
notice and recover, one scenario after the other on a simulated fleet (Ray, 4 sim replicas).

Each scenario starts a fresh fleet and runs a rollout of ``--requests`` generations, ``--concurrency``
at a time, each with a budget drawn up to ``--budget`` tokens (``ignore_eos``, through the resuming
client, so every one must come back with exactly its budget); the fault comes ``--fault-at`` seconds
in:

* ``replica SIGKILL``: the replica actor's process is killed;
* ``replica hang``: its engine stops answering (its process lives on);
* ``replica SIGSTOP + update``: the actor's process is stopped, then a weight update is pushed;
* ``update storm``: an abort-mode weight update every 0.3 s for the whole rollout;
* ``cancellation storm``: ``--cancel`` requests, each cancelled at a random moment;
* ``sessions``: ``--sessions`` concurrent short sessions.

Reported per scenario: requests lost (an error reached the caller), duplicated (more tokens than the
budget) and truncated (fewer), the in-flight count left over, the time to detect the fault (the
controller marks the replica dead), to recover (it serves again), how long the weight update took,
and the fleet-frozen time: the longest stretch with no generation finishing anywhere (the whole
fleet, not the faulty replica). Node removal is covered by ``tests/manager/cluster`` (a real
multi-node Ray cluster), not here.

Run: ``python benchmarks/faults.py`` (about 3 minutes on 2 cores); ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable, Optional

from rich.console import Console
from rich.table import Table

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.config import RayConfig, RollfleetConfig
from rollfleet.manager import LLMServerManager
from rollfleet.manager.ray_runtime import ensure_ray

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


def fleet_config(args: argparse.Namespace) -> RollfleetConfig:
    return RollfleetConfig.model_validate(
        {
            "rollout": {
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
            },
        }
    )


async def watch_victim(manager: LLMServerManager, since: float, out: Outcome, stop: asyncio.Event) -> None:
    """Times from the fault to the victim marked dead (detect) and back to healthy (recover)."""
    while not stop.is_set():
        state = (await manager.status()).replicas[VICTIM].state
        now = time.monotonic() - since
        if out.detect_s is None and state not in ("healthy", "suspect"):
            out.detect_s = now
        elif out.detect_s is not None and out.recover_s is None and state == "healthy":
            out.recover_s = now
            return
        await asyncio.sleep(0.05)


async def rollout(
    manager: LLMServerManager,
    args: argparse.Namespace,
    name: str,
    fault: Optional[Callable[[Outcome, float], Awaitable[Optional[asyncio.Task[None]]]]],
    watch: bool = True,
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
            watcher = asyncio.ensure_future(watch_victim(manager, fault_at, out, stop))
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


async def victim_pid(manager: LLMServerManager) -> int:
    return int((await manager.replica_stats())[VICTIM]["pid"])


async def scenario(args: argparse.Namespace, name: str) -> Outcome:
    manager = await LLMServerManager.create(fleet_config(args))
    try:
        if name == "replica SIGKILL":

            async def kill(out: Outcome, at: float) -> None:
                os.kill(await victim_pid(manager), signal.SIGKILL)
                return None

            return await rollout(manager, args, name, kill)
        if name == "replica hang":

            async def hang(out: Outcome, at: float) -> None:
                await manager.inject_fault(VICTIM, "hang")
                return None

            return await rollout(manager, args, name, hang)
        if name == "replica SIGSTOP + update":
            pid = await victim_pid(manager)

            async def stop_and_update(out: Outcome, at: float) -> None:
                os.kill(pid, signal.SIGSTOP)
                began = time.monotonic()
                version = (await manager.status()).current_version + 1
                await manager.update_weights({"step": version}, version)
                out.update_s = time.monotonic() - began
                out.updates = 1
                return None

            try:
                return await rollout(manager, args, name, stop_and_update)
            finally:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        if name == "update storm":

            async def storm(out: Outcome, at: float) -> asyncio.Task[None]:
                async def loop() -> None:
                    version = (await manager.status()).current_version
                    while True:
                        await asyncio.sleep(0.3)
                        version += 1
                        began = time.monotonic()
                        await manager.update_weights({"step": version}, version, "abort")
                        out.update_s = max(out.update_s or 0.0, time.monotonic() - began)
                        out.updates += 1

                return asyncio.ensure_future(loop())

            return await rollout(manager, args, name, storm, watch=False)
        if name == "cancellation storm":
            return await cancellations(manager, args)
        if name == "sessions":
            return await sessions(manager, args)
        raise ValueError(name)
    finally:
        await manager.shutdown()


async def cancellations(manager: LLMServerManager, args: argparse.Namespace) -> Outcome:
    out = Outcome("cancellation storm", requests=args.cancel)
    client = manager.get_client(FullyAsyncLLMServerClient)
    rng = random.Random(0)
    started = time.monotonic()
    tasks = [
        asyncio.ensure_future(
            client.generate(f"c{i}", prompt_ids=[3, 4, 5], sampling_params={"max_tokens": 64, "ignore_eos": True})
        )
        for i in range(args.cancel)
    ]
    for task in tasks:
        asyncio.get_running_loop().call_later(rng.uniform(0, 2.0), task.cancel)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    out.lost = sum(isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError) for r in results)
    out.cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
    out.wall_s = time.monotonic() - started
    await asyncio.sleep(1.0)  # replicas see the cancels
    stats = await manager.status()
    out.inflight_left = client.balancer.get_total_inflight() + sum(r.inflight or 0 for r in stats.replicas.values())
    return out


async def sessions(manager: LLMServerManager, args: argparse.Namespace) -> Outcome:
    out = Outcome("sessions", requests=args.sessions)
    client = manager.get_client(FullyAsyncLLMServerClient)
    started = time.monotonic()

    async def one(i: int) -> None:
        try:
            o = await client.generate(
                f"s{i}", prompt_ids=[3, 4, 5 + i % 1000], sampling_params={"max_tokens": 8, "ignore_eos": True}
            )
            out.truncated += len(o.token_ids) < 8
            out.duplicated += len(o.token_ids) > 8
        except Exception:
            out.lost += 1
        finally:
            client.finish_session(f"s{i}")

    await asyncio.gather(*(one(i) for i in range(args.sessions)))
    out.wall_s = time.monotonic() - started
    out.inflight_left = client.balancer.get_total_inflight()
    return out


SCENARIOS = (
    "replica SIGKILL",
    "replica hang",
    "replica SIGSTOP + update",
    "update storm",
    "cancellation storm",
    "sessions",
)


def fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


async def main_async(args: argparse.Namespace) -> list[Outcome]:
    console = Console(width=160)
    outcomes = []
    for name in args.scenarios or SCENARIOS:
        console.print(f"[bold]{name}[/bold] ...")
        outcome = await scenario(args, name)
        console.print(f"  {asdict(outcome)}")
        outcomes.append(outcome)
    title = (
        f"faults on 4 sim replicas ({args.requests} generations of <= {args.budget} tokens, {args.concurrency} at once)"
    )
    table = Table(title=title)
    for col in ("scenario", "requests", "lost", "dup.", "trunc.", "cancelled", "in flight after", "detect s",
                "recover s", "updates", "longest update s", "fleet frozen s", "wall s"):  # fmt: skip
        table.add_column(col, justify="right" if col != "scenario" else "left")
    for o in outcomes:
        table.add_row(
            o.scenario, str(o.requests), str(o.lost), str(o.duplicated), str(o.truncated), str(o.cancelled),
            str(o.inflight_left), fmt(o.detect_s), fmt(o.recover_s), str(o.updates), fmt(o.update_s),
            fmt(o.frozen_s), fmt(o.wall_s),
        )  # fmt: skip
    console.print(table)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--budget", type=int, default=300)
    parser.add_argument("--fault-at", type=float, default=2.0, help="seconds into the rollout")
    parser.add_argument("--cancel", type=int, default=5000)
    parser.add_argument("--sessions", type=int, default=10000)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--scenarios", nargs="*", choices=SCENARIOS)
    parser.add_argument("--json", help="write the outcomes here")
    args = parser.parse_args()
    ensure_ray(RayConfig(num_cpus=8))  # once for every scenario's fleet
    outcomes = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(o) for o in outcomes], f, indent=2)


if __name__ == "__main__":
    main()
