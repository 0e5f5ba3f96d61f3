"""What rollfleet costs on top of vLLM: the same batch sent straight to vLLM's HTTP server and
through rollfleet's client (routing, Ray actor hop, validation, version stamping), side by side.

One vLLM CPU replica with the built-in tiny model; the batch is ``--requests`` completions of
``--max-tokens`` tokens each (``ignore_eos``, so both paths generate exactly the same number of
tokens), ``--concurrency`` in flight. The two paths alternate for ``--rounds`` rounds so that
drift on the machine hits both equally; the table reports the median of each.

Run: ``python benchmarks/engine_overhead.py`` (about 2 minutes on 2 cores, start-up included).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import httpx
from rich.console import Console
from rich.table import Table

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from rollfleet.config import RollfleetConfig  # noqa: E402
from rollfleet.manager import LLMServerManager  # noqa: E402


def prompts(n: int) -> list[list[int]]:
    return [[5 + (i * 7 + j) % 400 for j in range(32)] for i in range(n)]


async def bounded(concurrency: int, jobs):
    sem = asyncio.Semaphore(concurrency)

    async def run(job):
        async with sem:
            return await job()

    return await asyncio.gather(*(run(j) for j in jobs))


async def direct_round(address: str, batch: list[list[int]], max_tokens: int, concurrency: int) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=address, timeout=600, limits=limits) as http:

        def job(i: int, prompt: list[int]):
            async def go() -> int:
                body = {
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "ignore_eos": True,
                    "logprobs": 0,
                    "return_token_ids": True,
                }
                resp = await http.post("/v1/completions", json=body, headers={"X-Request-Id": f"direct-{i}-{time.monotonic_ns()}"})
                resp.raise_for_status()
                return len(resp.json()["choices"][0]["token_ids"])

            return go

        start = time.perf_counter()
        counts = await bounded(concurrency, [job(i, p) for i, p in enumerate(batch)])
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


async def main_async(args: argparse.Namespace) -> None:
    config = RollfleetConfig.model_validate(
        {
            "rollout": {"name": "vllm", "model": "tiny", "num_replicas": 1, "max_model_len": 512, "response_length": args.max_tokens},
            "ray": {"num_cpus": 2},
        }
    )
    console = Console(width=140)
    console.print("starting one vLLM CPU replica (tiny model)...")
    manager = await LLMServerManager.create(config)
    try:
        address = (await manager.get_addresses())[0]
        client = manager.get_client()
        batch = prompts(args.requests)
        await direct_round(address, batch[:16], 8, 16)  # warm both paths
        await rollfleet_round(client, batch[:16], 8, 16)
        direct, ours = [], []
        for r in range(args.rounds):
            wall, toks = await direct_round(address, batch, args.max_tokens, args.concurrency)
            direct.append(toks / wall)
            wall, toks = await rollfleet_round(client, batch, args.max_tokens, args.concurrency)
            ours.append(toks / wall)
            console.print(f"round {r + 1}/{args.rounds}: direct {direct[-1]:,.0f} tok/s, rollfleet {ours[-1]:,.0f} tok/s")
    finally:
        await manager.shutdown()
    d, o = statistics.median(direct), statistics.median(ours)
    table = Table(title=f"engine overhead: {args.requests} requests x {args.max_tokens} tokens, {args.concurrency} in flight")
    table.add_column("path")
    table.add_column("output tokens/s (median)", justify="right")
    table.add_row("direct HTTP to vLLM", f"{d:,.0f}")
    table.add_row("rollfleet client -> replica actor -> vLLM", f"{o:,.0f}")
    table.add_row("ratio (rollfleet / direct)", f"{o / d:.3f}x  (overhead {100 * (1 - o / d):+.1f}%)")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
