"""What a weight update costs a fleet that is generating, per update mode, side by side in one run.

Two vLLM CPU replicas of the built-in tiny model (about 2.4 MB of weights). Each round sends the
same batch (``--requests`` completions of ``--max-tokens`` tokens, ``ignore_eos``, through the
resuming client) and pushes a new version of the weights every ``--interval`` seconds until the
batch is done, once per mode: ``abort`` (in-flight requests come back aborted and are resubmitted
with their tokens so far), ``keep`` (they are frozen with their KV cache and continue on the new
weights) and ``rolling`` (``keep`` in waves of half the fleet). Modes alternate in ABC/CBA order
over ``--rounds`` rounds so that drift on the shared machine hits them alike.

Reported per mode: the batch's wall time and throughput, updates done, the longest replica pause
per update (what the engine reports: from pausing to generating again), the whole update (stage +
commit + verify), resubmissions, and the prompt tokens vLLM prefilled beyond the batch's own (read
from each server's ``vllm:prompt_tokens_total``): what aborting costs in recomputation. A PNG
(``--plot``) shows throughput and pause per mode.

Run: ``python benchmarks/weight_sync.py`` (about 4 minutes on 2 cores, start-up included).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.config import RollfleetConfig
from rollfleet.manager import LLMServerManager

MODES = ("abort", "keep", "rolling")


@dataclass
class Run:
    mode: str
    wall_s: float = 0.0
    tokens: int = 0
    updates: int = 0
    pause_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    resumes: int = 0
    reprefilled: int = 0
    at_once: int = 0  # the most replicas paused together (a commit wave)
    replicas: int = 0


def tiny_state_dict(seed: int) -> dict:
    """The tiny model's weights, slightly perturbed per version (a real update changes them)."""
    import glob

    import torch
    from safetensors.torch import load_file

    from rollfleet.models import get_model_path

    state: dict = {}
    for f in glob.glob(f"{get_model_path('tiny')}/*.safetensors"):
        state.update(load_file(f))
    g = torch.Generator().manual_seed(seed)
    return {k: v + 1e-4 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in state.items()}


async def prompt_tokens(addresses: list[str]) -> float:
    """Prompt tokens every vLLM server has processed so far (its ``vllm:prompt_tokens_total``)."""
    total = 0.0
    async with httpx.AsyncClient(timeout=10) as http:
        for address in addresses:
            text = (await http.get(f"{address}/metrics")).text
            for family in text_string_to_metric_families(text):
                if family.name == "vllm:prompt_tokens":
                    total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


async def one_run(manager, client, addresses, mode: str, version: int, args, batch) -> tuple[Run, int]:
    run = Run(mode)
    before = await prompt_tokens(addresses)

    async def job(i: int, prompt: list[int]):
        out = await client.generate(
            f"ws-{mode}-{version}-{i}",
            prompt_ids=prompt,
            sampling_params={"max_tokens": args.max_tokens, "temperature": 1.0, "ignore_eos": True},
        )
        run.resumes += int(out.extra_fields.get("num_resumes", 0))
        return len(out.token_ids)

    started = time.perf_counter()
    work = asyncio.gather(*(job(i, p) for i, p in enumerate(batch)))
    while True:
        try:
            counts = await asyncio.wait_for(asyncio.shield(work), args.interval)
            break
        except asyncio.TimeoutError:
            version += 1
            result = await manager.update_weights(tiny_state_dict(version), version, mode=mode)
            run.updates += 1
            run.pause_s.append(result["pause_s"])
            run.update_s.append(result["total_s"])
            run.replicas = result["replicas"]
            run.at_once = max(run.at_once, -(-result["replicas"] // result["waves"]))
    run.wall_s = time.perf_counter() - started
    run.tokens = sum(counts)
    run.reprefilled = int(await prompt_tokens(addresses) - before - sum(len(p) for p in batch))
    return run, version


async def main_async(args: argparse.Namespace) -> dict[str, list[Run]]:
    config = RollfleetConfig.model_validate(
        {
            "rollout": {
                "name": "vllm",
                "model": "tiny",
                "num_replicas": 2,
                "prompt_length": 32,
                "max_model_len": args.max_tokens + 64,
                "response_length": args.max_tokens,
                "vllm": {"extra_args": ["--hf-overrides", f'{{"max_position_embeddings": {args.max_tokens + 64}}}']},
                "weight_sync": {"max_unavailable": 0.5},
                # every abort costs a resume: let them all resume (the default budget is 16 attempts)
                "retry": {"max_attempts": 1000},
            },
            "ray": {"num_cpus": 2},
        }
    )
    console = Console(width=150)
    console.print("starting two vLLM CPU replicas (tiny model)...")
    manager = await LLMServerManager.create(config)
    runs: dict[str, list[Run]] = {m: [] for m in MODES}
    try:
        addresses = await manager.get_addresses()
        client = manager.get_client(FullyAsyncLLMServerClient)
        batch = [[5 + (i * 13 + j) % 400 for j in range(24)] for i in range(args.requests)]
        version = 0
        _, version = await one_run(manager, client, addresses, "keep", version, args, batch[:2])  # warm-up
        with Progress(console=console) as progress:
            bar = progress.add_task("rounds", total=args.rounds * len(MODES))
            for r in range(args.rounds):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    run, version = await one_run(manager, client, addresses, mode, version, args, batch)
                    runs[mode].append(run)
                    progress.update(bar, advance=1, description=f"round {r + 1} {mode}: {run.wall_s:.1f} s")
    finally:
        await manager.shutdown()
    nbytes = sum(t.numel() * t.element_size() for t in tiny_state_dict(0).values())
    render(console, runs, nbytes)
    if args.plot:
        plot(runs, args.plot)
        console.print(f"plot: {args.plot}")
    return runs


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def render(console: Console, runs: dict[str, list[Run]], nbytes: int) -> None:
    table = Table(
        title="weight updates while generating: 2 vLLM CPU replicas, tiny model, same batch per mode",
        caption=f"each update stages {nbytes / 1e6:.2f} MB: one object-store copy and one tmpfs file per node",
    )
    for col in ("mode", "wall s", "tokens/s", "vs abort", "updates", "pause ms (median/max)", "paused at once",
                "update ms (median)", "resumes", "re-prefilled tokens"):  # fmt: skip
        table.add_column(col, justify="right")
    base = sum(r.tokens for r in runs["abort"]) / max(1e-9, sum(r.wall_s for r in runs["abort"]))
    for mode, rs in runs.items():
        rate = sum(r.tokens for r in rs) / max(1e-9, sum(r.wall_s for r in rs))
        pauses = [p for r in rs for p in r.pause_s]
        table.add_row(
            mode,
            f"{sum(r.wall_s for r in rs) / len(rs):.1f}",
            f"{rate:.0f}",
            f"{rate / base:.2f}x",
            str(sum(r.updates for r in rs)),
            f"{_med(pauses) * 1e3:.0f} / {max(pauses, default=float('nan')) * 1e3:.0f}",
            f"{max(r.at_once for r in rs)}/{max(r.replicas for r in rs)}",
            f"{_med([u for r in rs for u in r.update_s]) * 1e3:.0f}",
            str(sum(r.resumes for r in rs)),
            str(sum(r.reprefilled for r in rs)),
        )
    console.print(table)


def plot(runs: dict[str, list[Run]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(runs)
    rates = [sum(r.tokens for r in runs[m]) / max(1e-9, sum(r.wall_s for r in runs[m])) for m in modes]
    pauses = [_med([p for r in runs[m] for p in r.pause_s]) * 1e3 for m in modes]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar(modes, rates, color=["#c44e52", "#55a868", "#4c72b0"])
    a.set_ylabel("tokens/s while updating")
    a.set_title("throughput")
    b.bar(modes, pauses, color=["#c44e52", "#55a868", "#4c72b0"])
    b.set_ylabel("ms")
    b.set_title("replica pause per update (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between updates")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--plot", default="benchmarks/weight_sync.png")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
