"""Routing hot path: rollfleet's in-process balancers vs verl's single balancer actor.

Both sides route the same workload to 8 replicas from 1,024 concurrent callers:

* **baseline** — verl's deployment, faithfully: one ``GlobalRequestLoadBalancer`` as one Ray actor
  (synchronous, concurrency 1), policy ``least_inflight``; each request pays one ``acquire_server``
  and one ``release_server`` round trip (here the release is awaited; verl fires and forgets it).
* **rollfleet** — the client's hot path: 8 agent-loop workers, each with its own in-process
  balancer (policy ``least_tokens``). Nobody counts every request: each worker sees its own live
  counts plus the replicas' reports, piggybacked on every response and
  refreshed every ``routing.load_refresh_interval_s`` (1 s by default).

Measured, side by side in one run:
1. a burst of 10,000 requests with zero service time: wall time to route them all, decisions/s,
   and the p50/p99 added latency per request (acquire + release);
2. a steady workload (service time ~ exponential, mean 20 ms): load imbalance, the time-averaged
   max/mean in-flight requests per replica.

Run: ``python benchmarks/routing.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from rollfleet.config import RoutingConfig
from rollfleet.routing import GlobalRequestLoadBalancer
from rollfleet.types import LoadReport

N_REPLICAS = 8
N_WORKERS = 8


@dataclass
class Result:
    name: str
    burst_s: float
    decisions_per_s: float
    p50_ms: float
    p99_ms: float
    imbalance: float


class Truth:
    """The replicas' real in-flight counts (what each replica would report)."""

    def __init__(self, ids: list[str]) -> None:
        self.inflight = {i: 0 for i in ids}
        self.tokens = {i: 0 for i in ids}

    def report(self, rid: str) -> LoadReport:
        return LoadReport(replica_id=rid, inflight=self.inflight[rid], inflight_tokens=self.tokens[rid])


async def sample_imbalance(truth: Truth, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        counts = list(truth.inflight.values())
        total = sum(counts)
        if total >= len(counts):
            out.append(max(counts) / (total / len(counts)))
        await asyncio.sleep(0.005)


async def drive(n_requests: int, concurrency: int, route, service_mean_s: float, rng: random.Random) -> list[float]:
    """Run ``n_requests`` through ``route(i, hold_s) -> latency`` with ``concurrency`` callers."""
    latencies: list[float] = []
    counter = iter(range(n_requests))

    async def caller() -> None:
        for i in counter:
            hold = rng.expovariate(1.0 / service_mean_s) if service_mean_s > 0 else 0.0
            latencies.append(await route(i, hold))

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return latencies


async def run_baseline(
    n_requests: int, concurrency: int, service_mean_s: float, seed: int
) -> tuple[list[float], float, float]:
    import ray

    ids = [f"replica-{i}" for i in range(N_REPLICAS)]
    actor = ray.remote(max_concurrency=1, num_cpus=0)(GlobalRequestLoadBalancer).remote({i: None for i in ids})
    await actor.get_total_inflight.remote()
    truth = Truth(ids)
    prompt_lens = random.Random(seed)

    async def route(i: int, hold: float) -> float:
        t0 = time.perf_counter()
        sid, _ = await actor.acquire_server.remote(f"req-{i}")
        added = time.perf_counter() - t0
        plen = prompt_lens.randrange(100, 4000)
        truth.inflight[sid] += 1
        truth.tokens[sid] += plen
        if hold:
            await asyncio.sleep(hold)
        truth.inflight[sid] -= 1
        truth.tokens[sid] -= plen
        t1 = time.perf_counter()
        await actor.release_server.remote(sid)
        return added + time.perf_counter() - t1

    stop = asyncio.Event()
    samples: list[float] = []
    sampler = asyncio.ensure_future(sample_imbalance(truth, stop, samples))
    start = time.perf_counter()
    lat = await drive(n_requests, concurrency, route, service_mean_s, random.Random(seed))
    wall = time.perf_counter() - start
    stop.set()
    await sampler
    ray.kill(actor)
    return lat, wall, statistics.fmean(samples) if samples else 1.0


async def run_rollfleet(
    n_requests: int, concurrency: int, service_mean_s: float, seed: int
) -> tuple[list[float], float, float]:
    ids = [f"replica-{i}" for i in range(N_REPLICAS)]
    workers = [
        GlobalRequestLoadBalancer({i: None for i in ids}, policy="least_tokens", seed=seed + w)
        for w in range(N_WORKERS)
    ]
    truth = Truth(ids)
    prompt_lens = random.Random(seed)
    stop = asyncio.Event()

    async def poll() -> None:  # the fleet view's periodic load refresh (the default interval)
        while not stop.is_set():
            await asyncio.sleep(RoutingConfig().load_refresh_interval_s)
            for lb in workers:
                for rid in ids:
                    lb.report_load(truth.report(rid))

    async def route(i: int, hold: float) -> float:
        lb = workers[i % N_WORKERS]
        plen = prompt_lens.randrange(100, 4000)
        t0 = time.perf_counter()
        sid, _ = lb.acquire_server(f"req-{i}", plen)
        added = time.perf_counter() - t0
        truth.inflight[sid] += 1
        truth.tokens[sid] += plen
        if hold:
            await asyncio.sleep(hold)
        truth.inflight[sid] -= 1
        truth.tokens[sid] -= plen
        report = truth.report(sid)  # piggybacked on the response
        t1 = time.perf_counter()
        lb.release_server(sid, plen)
        lb.report_load(report)
        lb.finish_session(f"req-{i}")
        return added + time.perf_counter() - t1

    samples: list[float] = []
    sampler = asyncio.ensure_future(sample_imbalance(truth, stop, samples))
    poller = asyncio.ensure_future(poll())
    start = time.perf_counter()
    lat = await drive(n_requests, concurrency, route, service_mean_s, random.Random(seed))
    wall = time.perf_counter() - start
    stop.set()
    await asyncio.gather(sampler, poller)
    return lat, wall, statistics.fmean(samples) if samples else 1.0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


async def main_async(args: argparse.Namespace) -> list[Result]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = []
    try:
        for name, runner in (
            ("baseline: verl single LB actor", run_baseline),
            ("rollfleet: in-process balancers", run_rollfleet),
        ):
            lat, wall, _ = await runner(args.burst, args.concurrency, 0.0, args.seed)
            _, _, imbalance = await runner(args.steady, args.concurrency, args.service_ms / 1000.0, args.seed)
            results.append(Result(name, wall, args.burst / wall, pct(lat, 0.5), pct(lat, 0.99), imbalance))
    finally:
        ray.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burst", type=int, default=10_000, help="requests in the burst")
    parser.add_argument("--steady", type=int, default=20_000, help="requests in the steady run")
    parser.add_argument("--concurrency", type=int, default=1024)
    parser.add_argument("--service-ms", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    base, ours = results
    table = Table(title=f"routing: {args.concurrency} concurrent callers, {N_REPLICAS} replicas")
    for col in (
        "",
        "burst of %d routed in" % args.burst,
        "decisions/s",
        "added p50",
        "added p99",
        "imbalance (max/mean)",
    ):
        table.add_column(col, justify="right" if col else "left")
    for r in results:
        table.add_row(
            r.name,
            f"{r.burst_s:.3f} s",
            f"{r.decisions_per_s:,.0f}",
            f"{r.p50_ms:.3f} ms",
            f"{r.p99_ms:.3f} ms",
            f"{r.imbalance:.3f}",
        )
    table.add_row(
        "ratio (rollfleet / baseline)",
        f"{ours.burst_s / base.burst_s:.4f}x",
        f"{ours.decisions_per_s / base.decisions_per_s:,.1f}x",
        f"{ours.p50_ms / base.p50_ms:.4f}x",
        f"{ours.p99_ms / base.p99_ms:.4f}x",
        f"{ours.imbalance / base.imbalance:.3f}x",
    )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
