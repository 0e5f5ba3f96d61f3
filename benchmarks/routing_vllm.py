"""Routing quality on real engines: the routing benchmark's GRPO finding, checked on 2 vLLM CPU replicas.

``benchmarks/routing_quality.py`` ranks the routing policies in virtual time on sim engines. This
runs the same kind of capacity-bound GRPO rollout on 2 vLLM CPU replicas of the ``tiny`` model
(real Ray fleet, real client, balancer and policies) and, next to it, on the simulator priced by
the ``vllm-cpu-tiny`` profile (measured on this machine by ``rollfleet calibrate``), so that what
the simulator predicts for each policy can be set against what vLLM does.

Workload: ``--groups`` groups x 8 samples of a 256-token prompt (fresh prompts every run, so no
run finds another's prompt cached), 8 sequences per replica (vLLM's ``max_num_seqs``), response
lengths set by the request (``max_tokens`` with ``ignore_eos``, so they are the same on both engines
and under every policy): each group draws a difficulty, each sample a log-normal length around it
(mean 64 tokens, up to 256; siblings' lengths related, as in the sim engine), about 16 times the
batch slots of work.

Policies: ``least_inflight`` (verl's), ``prefix_affinity`` (the default), ``prefix_affinity/late``
(late binding, ``routing.max_inflight_per_replica`` = 8 + ``--late-slack``, 2 by default;
arrival order),
``prefix_affinity/longest`` (late binding, ``routing.dispatch_order: longest_group_first``).

Reported per policy: the makespan (wall seconds on vLLM; simulated seconds on the sim), its ratio
to ``least_inflight``'s (on vLLM paired per round: the policies of one round run back to back, in
rotating order, on the same machine state), and the prompt tokens each engine computed (vLLM's own
prefix-cache counters: queried minus hit), as prefills of each group's prompt (vLLM also computes a
fully cached prompt's last 128-token block again; that is taken out), and the sequences an engine
step ran on average (every sample's tokens over the engine steps taken; 8 is a full batch). The JSON also keeps, per
run, diagnostics: each replica's engine steps (vLLM's step counter; a step's cost on these CPUs
depends on its batch and on the other replica's load, so steps do not measure work here) and
output tokens, the CPU time of this process (the client, its balancer and gate), and the mean time
a request spent outside vLLM's own latency (the client's timing less vLLM's end-to-end histogram:
the front end and transport both ways, and, late-bound, the wait in the client). Runs saved before
a diagnostic was added lack it.

Run: ``python benchmarks/routing_vllm.py [--rounds 5 --groups 48]`` (about 8 minutes on 2 cores);
writes ``benchmarks/routing_vllm.json`` (``--report-only`` prints its table again). ``--sim-only``
runs the simulator alone (seconds), to try what might explain vLLM's numbers: ``--sim-slow F``
makes one sim replica's steps take ``F`` times longer (the sim engine's ``slow`` fault), as a
replica that gets less of the shared CPUs would; ``--sim-overhead-ms M`` delays every result by
``M`` (the sim engine's ``request_overhead_ms``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import vllm_metrics

from rollfleet.config import RolloutConfig, RoutingConfig, SimEngineConfig
from rollfleet.plan import VirtualFleet
from rollfleet.plan.profiles import load_profile
from rollfleet.utils import virtual_time

POLICIES = ("least_inflight", "prefix_affinity", "prefix_affinity/late", "prefix_affinity/longest")
SAMPLES, PROMPT, SLOTS, LATE_SLACK = 8, 256, 8, 2
MEAN, SIGMA_GROUP, SIGMA_SAMPLE, MAX_TOKENS = 64, 0.6, 0.5, 256
#: vLLM computes a fully cached prompt's last block again (its block size on CPU): a group whose
#: prompt is prefilled ``k`` times computes k x PROMPT + (SAMPLES - k) x this, so k follows from
#: vLLM's counters. The sim engine serves a fully cached prompt from the cache.
VLLM_LAST_BLOCK = 128
OUT = Path(__file__).with_name("routing_vllm.json")


def lengths(groups: int, seed: int) -> list[list[int]]:
    """Response lengths per group and sample: a group difficulty, then each sample around it."""
    rng = random.Random(seed)
    mu = math.log(MEAN) - (SIGMA_GROUP**2 + SIGMA_SAMPLE**2) / 2
    out = []
    for _ in range(groups):
        centre = rng.gauss(mu, SIGMA_GROUP)
        out.append([min(MAX_TOKENS, max(4, int(math.exp(rng.gauss(centre, SIGMA_SAMPLE))))) for _ in range(SAMPLES)])
    return out


def routing(policy: str, base: RoutingConfig, seed: int, slack: int = LATE_SLACK) -> RoutingConfig:
    name, _, order = policy.partition("/")
    return base.model_copy(
        update={
            "policy": name,
            "seed": seed,
            "max_inflight_per_replica": SLOTS + slack if order else None,
            "dispatch_order": "longest_group_first" if order == "longest" else "fifo",
        }
    )


async def rollout(client: Any, tag: str, lens: list[list[int]], seed: int) -> tuple[float, float]:
    """Every sample of every group at once: the seconds until the last one ends (the loop's clock),
    and the seconds the requests took, summed (from when each was sent, late binding's wait included)."""
    rng = random.Random(f"{tag}-{seed}")
    prompts = [[rng.randrange(10, 1000) for _ in range(PROMPT)] for _ in lens]
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def sample(g: int, i: int) -> float:
        params = {"max_tokens": lens[g][i], "ignore_eos": True, "temperature": 1.0, "seed": g * 100 + i}
        sent = loop.time()
        out = await client.generate(f"{tag}-g{g}-s{i}", prompt_ids=prompts[g], sampling_params=params)
        assert len(out.token_ids) == lens[g][i], (len(out.token_ids), lens[g][i])
        return loop.time() - sent

    took = await asyncio.gather(*(sample(g, i) for g in range(len(lens)) for i in range(SAMPLES)))
    return loop.time() - started, sum(took)


def sim_config(policy: str, seed: int, slack: int = LATE_SLACK, overhead_ms: float = 0.0) -> RolloutConfig:
    costs = load_profile("vllm-cpu-tiny")
    return RolloutConfig(
        name="sim",
        num_replicas=2,
        prompt_length=512,
        response_length=MAX_TOKENS,
        max_model_len=1024,
        routing=routing(policy, RoutingConfig(), seed, slack),
        sim=SimEngineConfig(
            vocab_size=1024,
            max_num_seqs=SLOTS,
            cache_on_prefill=True,
            seed=seed,
            max_steps_per_wake=1_000_000,
            request_overhead_ms=overhead_ms,
            **costs,
        ),
    )


def simulate(
    policy: str, lens: list[list[int]], seed: int, slack: int = LATE_SLACK, slow: float = 1.0, overhead_ms: float = 0.0
) -> dict[str, float]:
    """One policy's rollout on 2 sim replicas (``slow``: replica-1's steps take that many times
    longer; ``overhead_ms``: the sim engine's ``request_overhead_ms``)."""

    async def run() -> dict[str, float]:
        fleet = await VirtualFleet(sim_config(policy, seed, slack, overhead_ms)).start()
        if slow != 1.0:
            fleet.replicas["replica-1"].engine.inject_fault("slow", slow)
        try:
            makespan, _ = await rollout(fleet.client, policy, lens, seed)
            report = await fleet.report()
            steps = [int(s["num_steps"]) for s in (await fleet.replica_stats()).values()]
            return {"makespan_s": makespan, "computed_prompt_tokens": report.prefill_tokens, "steps_per_replica": steps}
        finally:
            await fleet.shutdown()

    return virtual_time.run(run())


#: vLLM's own counters a run reads from each replica's /metrics, before and after
COUNTERS = {
    "steps": "vllm:iteration_tokens_total_count",  # engine steps (the per-step token histogram's count)
    "tokens": "vllm:generation_tokens_total",
    "queried": "vllm:prefix_cache_queries_total",
    "hit": "vllm:prefix_cache_hits_total",
    "e2e_s": "vllm:e2e_request_latency_seconds_sum",  # from arrival in vLLM's API server to the end
    "finished": "vllm:e2e_request_latency_seconds_count",
}


def counters(urls: list[str]) -> list[dict[str, float]]:
    """Each replica's :data:`COUNTERS` now, from one read of its /metrics."""
    out = []
    for url in urls:
        found = vllm_metrics.read(url, COUNTERS.values())
        out.append({key: found.get(name, 0.0) for key, name in COUNTERS.items()})
    return out


async def on_vllm(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    from rollfleet.client import FullyAsyncLLMServerClient
    from rollfleet.config import RollfleetConfig
    from rollfleet.manager import LLMServerManager

    config = RollfleetConfig.model_validate(
        {
            "rollout": {
                "name": "vllm", "model": "tiny", "num_replicas": 2, "prompt_length": 512,
                "response_length": MAX_TOKENS, "max_model_len": 1024,
                "routing": {"load_refresh_interval_s": 0.2},
                "vllm": {"max_num_seqs": SLOTS, "listen": "tcp"},  # tcp: this script reads vLLM's /metrics
            }
        }
    )  # fmt: skip
    manager = await LLMServerManager.create(config)
    rows: list[dict[str, Any]] = []
    try:
        urls = [r.address for r in await manager.get_replicas()]
        warm = manager.get_client(FullyAsyncLLMServerClient)
        await rollout(warm, "warm-up", lengths(4, 99), 99)  # first forward passes of each shape are slow
        await warm.close()
        with Progress(console=console) as progress:
            policies = args.policies
            task = progress.add_task("rounds on vLLM", total=args.rounds * len(policies))
            for r in range(args.rounds):
                lens = lengths(args.groups, r)
                for policy in policies[r % len(policies) :] + policies[: r % len(policies)]:
                    await asyncio.to_thread(vllm_metrics.settle, urls, 1.0)
                    routed = config.rollout.model_copy(
                        update={"routing": routing(policy, config.rollout.routing, r, args.late_slack)}
                    )
                    client = manager.get_client(FullyAsyncLLMServerClient, config=routed)
                    before = await asyncio.to_thread(counters, urls)
                    cpu0 = time.process_time()
                    wall, took = await rollout(client, f"r{r}-{policy}", lens, r)
                    client_cpu = time.process_time() - cpu0  # this process: the client, its balancer and gate
                    delta = [
                        {k: b[k] - a[k] for k in COUNTERS}
                        for a, b in zip(before, await asyncio.to_thread(counters, urls))
                    ]
                    prefill = sum(d["queried"] - d["hit"] for d in delta)  # prompt tokens computed
                    ran, made = [d["steps"] for d in delta], [d["tokens"] for d in delta]
                    # what a request spent outside vLLM's own latency (with late binding, also held back)
                    finished = sum(d["finished"] for d in delta)  # 0: a vLLM without that histogram
                    outside_ms = (took - sum(d["e2e_s"] for d in delta)) / finished * 1e3 if finished else float("nan")
                    await client.close()
                    rows.append({"round": r, "policy": policy, "makespan_s": wall, "computed_prompt_tokens": prefill,
                                 "steps_per_replica": ran, "tokens_per_replica": made,
                                 "client_cpu_s": client_cpu, "outside_vllm_ms": outside_ms})  # fmt: skip
                    progress.console.print(
                        f"round {r + 1} {policy}: {wall:.2f} s, engine steps {ran}, tokens {made}, {prefill:,.0f} prompt tokens "
                        f"computed, client CPU {client_cpu:.2f} s, {outside_ms:.1f} ms a request outside vLLM"
                    )
                    progress.advance(task)
    finally:
        await manager.shutdown()
    return rows


def prefills(engine: str, computed_tokens: float, groups: int) -> float:
    """How many times each group's prompt was prefilled, on average, from the prompt tokens computed."""
    per_group = computed_tokens / groups
    if engine == "vllm":
        return (per_group - SAMPLES * VLLM_LAST_BLOCK) / (PROMPT - VLLM_LAST_BLOCK)
    return per_group / PROMPT


def summarize(vllm_rows: list[dict[str, Any]], sim_rows: list[dict[str, Any]], groups: int) -> dict[str, Any]:
    """Per policy and engine; ratios are to ``least_inflight``'s run of the same round."""
    out: dict[str, Any] = {}
    for engine, rows in (("vllm", vllm_rows), ("sim", sim_rows)):
        if not rows:
            continue
        base = {r["round"]: r for r in rows if r["policy"] == "least_inflight"}
        for policy in dict.fromkeys(r["policy"] for r in rows):
            mine = [r for r in rows if r["policy"] == policy]
            ratios = sorted(r["makespan_s"] / base[r["round"]]["makespan_s"] for r in mine)
            out.setdefault(policy, {})[engine] = {
                "makespan_s": statistics.mean(r["makespan_s"] for r in mine),
                "vs_least_inflight": statistics.median(ratios),
                "vs_least_inflight_rounds": ratios,
                "computed_prompt_tokens": statistics.mean(r["computed_prompt_tokens"] for r in mine),
                "group_prompt_prefills": statistics.mean(
                    prefills(engine, r["computed_prompt_tokens"], groups) for r in mine
                ),
                # sequences an engine step ran, on average: every sample's tokens over the steps taken
                "seqs_per_step": statistics.mean(
                    sum(map(sum, lengths(groups, r["round"]))) / sum(r["steps_per_replica"]) for r in mine
                ),
            }
    return out


def report(summary: dict[str, Any], args: argparse.Namespace, console: Console) -> None:
    table = Table(
        title=f"{args.groups} groups x {SAMPLES} samples, 2 replicas x {SLOTS} slots, {args.rounds} rounds, "
        f"late-binding slack {args.late_slack} (vLLM: wall s; sim: simulated s, vllm-cpu-tiny profile)"
    )
    for col in ("policy", "vLLM makespan", "vs least_inflight: median (rounds)", "sim makespan",
                "sim vs least_inflight", "group prompt prefills: vLLM / sim", "seqs a step: vLLM / sim"):  # fmt: skip
        table.add_column(col, justify="left" if col == "policy" else "right")
    for policy, row in summary.items():
        s = row["sim"]
        v = row.get("vllm")  # none: --sim-only
        spread = ", ".join(f"{x:.2f}" for x in (v or s)["vs_least_inflight_rounds"])
        table.add_row(
            policy, f"{v['makespan_s']:.2f} s" if v else "-", f"{v['vs_least_inflight']:.3f}x ({spread})" if v else "-",
            f"{s['makespan_s']:.2f} s", f"{s['vs_least_inflight']:.3f}x" + ("" if v else f" ({spread})"),
            f"{v['group_prompt_prefills']:.2f}x / {s['group_prompt_prefills']:.2f}x" if v
            else f"- / {s['group_prompt_prefills']:.2f}x",
            f"{v['seqs_per_step']:.2f} / {s['seqs_per_step']:.2f}" if v else f"- / {s['seqs_per_step']:.2f}",
        )  # fmt: skip
    console.print(table)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--groups", type=int, default=48)
    parser.add_argument("--late-slack", type=int, default=LATE_SLACK, help="late binding's limit over the 8 slots")
    parser.add_argument(
        "--policies", nargs="+", choices=POLICIES, default=list(POLICIES), help="must include least_inflight"
    )
    parser.add_argument("--out", type=Path, default=OUT, help="the JSON to write (or read, with --report-only)")
    parser.add_argument("--report-only", action="store_true", help="summarize the runs saved in --out again")
    parser.add_argument("--sim-only", action="store_true", help="the simulator alone: print its table, write nothing")
    parser.add_argument("--sim-slow", type=float, default=1.0, help="with --sim-only: replica-1's step cost factor")
    parser.add_argument(
        "--sim-overhead-ms",
        type=float,
        default=0.0,
        help="with --sim-only: the sim engine's request_overhead_ms (a result's way back to its caller)",
    )
    args = parser.parse_args(argv)
    if args.sim_slow <= 0:
        parser.error(f"--sim-slow must be > 0, got {args.sim_slow}")
    if args.sim_overhead_ms < 0:
        parser.error(f"--sim-overhead-ms must be >= 0, got {args.sim_overhead_ms}")
    if (args.sim_slow != 1.0 or args.sim_overhead_ms) and not args.sim_only:
        parser.error("--sim-slow and --sim-overhead-ms need --sim-only: vLLM is checked against the plain simulator")
    if "least_inflight" not in args.policies:
        parser.error("--policies must include least_inflight: every ratio is to its run of the same round")
    console = Console(width=160)
    if args.report_only:
        saved = json.loads(args.out.read_text())
        args.groups, args.rounds, args.late_slack = saved["groups"], saved["rounds"], saved["late_slack"]
        report(summarize(saved["vllm"], saved["sim"], args.groups), args, console)
        return
    started = time.monotonic()
    sim_rows = [
        {
            "round": r,
            "policy": p,
            **simulate(p, lengths(args.groups, r), r, args.late_slack, args.sim_slow, args.sim_overhead_ms),
        }
        for r in range(args.rounds)
        for p in args.policies
    ]
    if args.sim_only:
        console.print(
            f"simulator only; replica-1's steps x{args.sim_slow:g}, {args.sim_overhead_ms:g} ms a result's way back"
        )
        report(summarize([], sim_rows, args.groups), args, console)
        return
    import ray

    ray.init(include_dashboard=False, num_cpus=3, log_to_driver=False)
    try:
        vllm_rows = asyncio.run(on_vllm(args, console))
    finally:
        ray.shutdown()
    summary = summarize(vllm_rows, sim_rows, args.groups)
    report(summary, args, console)
    saved = {"groups": args.groups, "rounds": args.rounds, "late_slack": args.late_slack, "summary": summary}
    args.out.write_text(json.dumps({**saved, "vllm": vllm_rows, "sim": sim_rows}, indent=2))
    console.print(f"done in {time.monotonic() - started:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
