"""What rollfleet costs on top of vLLM: the same batch sent straight to vLLM's HTTP server and
through rollfleet's client (routing, the hop to the replica, validation, version stamping), side by side.

One vLLM CPU replica with the built-in tiny model; the batch is ``--requests`` completions of
``--max-tokens`` tokens each (``ignore_eos``, so both paths generate exactly the same number of
tokens), ``--concurrency`` in flight. The two paths alternate (ABBA) for ``--rounds`` rounds so that
drift on the machine hits both equally; the table reports each path's tokens over its total time,
the spread of the rounds (on 2 shared cores one round varies by +-15%, which is why there are
many), and the CPU time per request of each group of processes: this client, the replica actor,
vLLM's process tree, and the rest of the machine (Ray's daemons, the controller). The CPU figures
are steadier than the throughput and show what rollfleet adds and where.
The direct path uses aiohttp + orjson with the exact body rollfleet's adapter sends: the fairest
baseline, so the ratio is what the hop through rollfleet costs and not a choice of HTTP library
(``--direct-client httpx`` shows that choice: httpx costs ~3.7 ms of CPU per request here).
``--data-plane ray`` measures verl's way (one Ray actor call per request) instead of rollfleet's
direct data plane.

Run: ``python benchmarks/engine_overhead.py`` (about 3 minutes on 2 cores, start-up included).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import statistics
import time
from dataclasses import dataclass

import aiohttp
import httpx
import orjson
import psutil
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from rollfleet.config import RollfleetConfig
from rollfleet.engines.vllm import wire as vllm_wire
from rollfleet.manager import LLMServerManager


def prompts(n: int) -> list[list[int]]:
    return [[5 + (i * 7 + j) % 400 for j in range(32)] for i in range(n)]


async def bounded(concurrency: int, jobs):
    sem = asyncio.Semaphore(concurrency)

    async def run(job):
        async with sem:
            return await job()

    return await asyncio.gather(*(run(j) for j in jobs))


def _body(prompt: list[int], max_tokens: int) -> dict:
    """The body rollfleet's vLLM adapter sends (``/inference/v1/generate``, token ids in and out,
    salted with the weights' label), built by the adapter's own wire module."""
    params = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "logprobs": 0}
    return vllm_wire.salted(vllm_wire.generate_body(prompt, params, 512)[0], "default")


def _tokens(raw: bytes, max_tokens: int) -> int:
    return len(vllm_wire.parse_generate(raw, max_tokens).token_ids)


async def direct_round(
    address: str, batch: list[list[int]], max_tokens: int, concurrency: int, http_client: str = "aiohttp"
) -> tuple[float, int]:
    """The batch straight to vLLM, with the best client we know (aiohttp + orjson) or httpx."""

    def headers(i: int) -> dict[str, str]:
        return {"X-Request-Id": f"direct-{i}-{time.monotonic_ns()}", "Content-Type": "application/json"}

    async with contextlib.AsyncExitStack() as stack:
        if http_client == "httpx":
            limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
            http = await stack.enter_async_context(httpx.AsyncClient(base_url=address, timeout=600, limits=limits))

            async def post(i: int, prompt: list[int]) -> int:
                resp = await http.post(vllm_wire.GENERATE_ROUTE, json=_body(prompt, max_tokens), headers=headers(i))
                resp.raise_for_status()
                return _tokens(resp.content, max_tokens)

        else:
            session = await stack.enter_async_context(
                aiohttp.ClientSession(
                    address, connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(600)
                )
            )

            async def post(i: int, prompt: list[int]) -> int:
                async with session.post(
                    vllm_wire.GENERATE_ROUTE, data=orjson.dumps(_body(prompt, max_tokens)), headers=headers(i)
                ) as resp:
                    resp.raise_for_status()
                    return _tokens(await resp.read(), max_tokens)

        start = time.perf_counter()
        counts = await bounded(concurrency, [functools.partial(post, i, p) for i, p in enumerate(batch)])
        return time.perf_counter() - start, sum(counts)


async def rollfleet_round(client, batch: list[list[int]], max_tokens: int, concurrency: int) -> tuple[float, int]:
    def job(i: int, prompt: list[int]):
        async def go() -> int:
            out = await client.generate(
                f"rf-{i}-{time.monotonic_ns()}",
                prompt_ids=prompt,
                sampling_params={"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "logprobs": 0},
            )
            return len(out.token_ids)

        return go

    start = time.perf_counter()
    counts = await bounded(concurrency, [job(i, p) for i, p in enumerate(batch)])
    return time.perf_counter() - start, sum(counts)


class CpuMeter:
    """CPU seconds (user + system) of three groups of processes: this benchmark's process, the
    replica actor's process, and vLLM's process tree; plus the whole machine's busy time, so the
    rest (Ray's own daemons, the controller) shows too."""

    def __init__(self, replica_pid: int, vllm_pid: int) -> None:
        self.me = psutil.Process()
        self.replica = psutil.Process(replica_pid)
        self.vllm = psutil.Process(vllm_pid)

    @staticmethod
    def _cpu(proc: "psutil.Process") -> float:
        t = proc.cpu_times()
        return t.user + t.system

    def sample(self) -> dict[str, float]:
        vllm = self._cpu(self.vllm) + sum(self._cpu(c) for c in self.vllm.children(recursive=True))
        machine = psutil.cpu_times()
        busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
        return {"client": self._cpu(self.me), "replica": self._cpu(self.replica), "vllm": vllm, "machine": busy}


@dataclass
class Round:
    wall: float
    tokens: int
    requests: int
    cpu: dict[str, float]  # seconds per group during the round

    @property
    def rate(self) -> float:
        return self.tokens / self.wall

    def ms_per_request(self, group: str) -> float:
        if group == "other":
            value = self.cpu["machine"] - self.cpu["client"] - self.cpu["replica"] - self.cpu["vllm"]
        else:
            value = self.cpu[group]
        return 1000.0 * value / self.requests


async def measured(meter: CpuMeter, coro) -> Round:
    before = meter.sample()
    wall, tokens = await coro
    after = meter.sample()
    return Round(wall, tokens, 0, {k: after[k] - before[k] for k in after})


def _sum_rounds(rounds: list[Round]) -> Round:
    cpu = {k: sum(r.cpu[k] for r in rounds) for k in rounds[0].cpu}
    return Round(sum(r.wall for r in rounds), sum(r.tokens for r in rounds), sum(r.requests for r in rounds), cpu)


async def main_async(args: argparse.Namespace) -> None:
    config = RollfleetConfig.model_validate(
        {
            "rollout": {
                "name": "vllm",
                "model": "tiny",
                "num_replicas": 1,
                "prompt_length": 64,
                "max_model_len": 512,
                "response_length": args.max_tokens,
                "data_plane": args.data_plane,
                "vllm": {"listen": "tcp"},  # the direct path calls the vLLM server itself, over TCP
            },
            "ray": {"num_cpus": 2},
        }
    )
    console = Console(width=150)
    console.print("starting one vLLM CPU replica (tiny model)...")
    manager = await LLMServerManager.create(config)
    try:
        address = (await manager.get_addresses())[0]
        stats = next(iter((await manager.replica_stats()).values()))
        meter = CpuMeter(int(stats["pid"]), int(stats["vllm_pid"]))
        client = manager.get_client()
        batch = prompts(args.requests)
        for _ in range(2):  # warm both paths (connections, vLLM's first batches)
            await direct_round(address, batch[:64], 16, args.concurrency, args.direct_client)
            await rollfleet_round(client, batch[:64], 16, args.concurrency)
        direct: list[Round] = []
        ours: list[Round] = []
        with Progress(console=console) as progress:
            bar = progress.add_task("rounds (direct + rollfleet)", total=args.rounds)
            for r in range(args.rounds):
                # ABBA order: slow drift of the machine hits both paths alike
                order = ("direct", "rollfleet") if r % 2 == 0 else ("rollfleet", "direct")
                for path in order:
                    if path == "direct":
                        direct.append(
                            await measured(
                                meter,
                                direct_round(address, batch, args.max_tokens, args.concurrency, args.direct_client),
                            )
                        )
                    else:
                        ours.append(
                            await measured(meter, rollfleet_round(client, batch, args.max_tokens, args.concurrency))
                        )
                    (direct if path == "direct" else ours)[-1].requests = len(batch)
                progress.update(
                    bar, advance=1, description=f"round {r + 1}: ratio {ours[-1].rate / direct[-1].rate:.3f}"
                )
    finally:
        await manager.shutdown()
    render(console, args, direct, ours, client.config.data_plane)


def render(console: Console, args: argparse.Namespace, direct: list[Round], ours: list[Round], data_plane: str) -> None:
    d, o = _sum_rounds(direct), _sum_rounds(ours)
    ratio = o.rate / d.rate
    ratios = sorted(a.rate / b.rate for a, b in zip(ours, direct))
    groups = ("client", "replica", "vllm", "other")
    table = Table(
        title=f"engine overhead: {args.requests} requests x {args.max_tokens} tokens, {args.concurrency} in flight, "
        f"{args.rounds} rounds per path, {os.cpu_count()} cores"
    )
    table.add_column("path")
    table.add_column("output tokens/s", justify="right")
    table.add_column("per round", justify="right")
    for g in groups:
        table.add_column(f"CPU ms/req {g}", justify="right")
    for name, rounds, total in (
        (f"direct HTTP to vLLM ({args.direct_client})", direct, d),
        (f"rollfleet client -> replica ({data_plane}) -> vLLM", ours, o),
    ):
        table.add_row(
            name,
            f"{total.rate:,.0f}",
            f"{min(r.rate for r in rounds):,.0f}..{max(r.rate for r in rounds):,.0f}",
            *(f"{total.ms_per_request(g):.2f}" for g in groups),
        )
    console.print(table)
    # What rollfleet adds on the machine's CPUs, per request, next to what a request costs in all.
    added = (o.ms_per_request("client") + o.ms_per_request("replica")) - d.ms_per_request("client")
    per_request = sum(d.ms_per_request(g) for g in groups)
    console.print(
        f"throughput ratio (rollfleet / direct, all rounds): [bold]{ratio:.3f}x[/bold] (overhead {100 * (1 - ratio):+.1f}%; "
        f"target < 3%); paired rounds: median {statistics.median(ratios):.3f}, range {ratios[0]:.3f}..{ratios[-1]:.3f}"
    )
    console.print(
        f"CPU rollfleet adds outside vLLM: {added:+.2f} ms per request, {100 * added / per_request:+.1f}% of the "
        f"{per_request:.1f} ms of CPU a request costs on this machine (client + replica + vLLM + the rest)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--data-plane", choices=["direct", "ray"], default="direct")
    parser.add_argument(
        "--direct-client",
        choices=["aiohttp", "httpx"],
        default="aiohttp",
        help="HTTP client of the direct path (aiohttp: the fair baseline)",
    )
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
