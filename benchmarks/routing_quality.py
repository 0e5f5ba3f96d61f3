"""Routing quality: how close each routing policy gets a rollout to its lower bound, in virtual time.

Every policy serves the same work (response lengths are fixed by per-sample seeds, so they do not
depend on where a request runs) on a :class:`rollfleet.plan.VirtualFleet`: the real replicas,
client, balancer and policies over sim engines, on a virtual clock, so the numbers are the same on
any host and under any load. The engines cache a prompt's blocks once it is prefilled
(``cache_on_prefill``), as vLLM does.

Workloads (``--replicas`` replicas, ``--max-num-seqs`` sequences each):

* ``grpo capacity``: 256 groups x 8 samples, a 512-token prompt per group, responses log-normal
  (mean 150, sigma 0.8) up to 512: 16 times the batch slots, so the work, not the longest sample,
  decides (the bound is about six times the longest sample alone);
* ``grpo unrelated``: the same, but each sample's length is drawn on its own (the sim engine
  otherwise draws a difficulty per prompt, so siblings' lengths are related);
* ``grpo n16``: the same samples as 128 groups x 16 (a prompt's first sample cannot find it cached:
  the hit rate's ceiling is 1 - 1/n, 87.5% for groups of 8 and 93.75% for 16);
* ``grpo tail``: 16 groups x 4 samples, responses with a longer tail (mean 300, sigma 1.4) up to
  2,048: fewer sequences than slots, so the longest sample decides;
* ``sessions``: 128 sessions x 4 turns; every session starts with the same 512-token system
  prompt, then a 64-token task; each turn appends the answer and a 48-token tool reply.

Reported per policy: makespan over the lower bound, where the bound is the larger of (a) the
longest trajectory alone on an idle replica and (b) all the work spread perfectly: every decode
token at full-batch throughput, every distinct prompt prefilled once, divided by the replicas;
busy-time imbalance (busiest replica over the mean), prefix-cache hit rate, prompt tokens
prefilled, and for GRPO the group prompt's prefill per group in prompt lengths (1.0: once).

Policies: every registered one without late binding; ``prefix_affinity/late``, the same with late
binding (``routing.max_inflight_per_replica`` = batch slots + ``--late-slack``, FIFO);
``prefix_affinity/longest``, late binding with ``routing.dispatch_order: longest_group_first`` (a
probe sample of each prompt first, then the siblings of the groups whose probe ran longest).
Each engine caches in its free KV blocks, as vLLM does (a sibling held back long enough finds its
prompt evicted and prefills it again); ``--prefix-cache-blocks`` bounds the free blocks it keeps.

Each (workload, policy) runs once per seed (``--seeds``, default 0-9: the seed draws the
prompts and response lengths and seeds the policies); the table shows the mean and, for the
makespan over the bound and over ``least_inflight``'s, the range. Ten seeds, not fewer: one
seed far from the rest moved a 3-seed mean by a point, as much as the best policies differ.

Run: ``python benchmarks/routing_quality.py`` (a few minutes on 2 cores); ``--json`` writes the
numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rollfleet.config import RolloutConfig, RoutingConfig, SimEngineConfig
from rollfleet.engines.sim import StepCost
from rollfleet.plan import FleetReport, VirtualFleet
from rollfleet.utils import virtual_time

#: "/late": the same policy with late binding (routing.max_inflight_per_replica = batch slots + LATE_SLACK);
#: "/longest": late binding that sends the longest-estimated groups first (routing.dispatch_order)
POLICIES = (
    "least_inflight", "least_tokens", "power_of_two", "rendezvous", "prefix_affinity", "prefix_affinity/late",
    "prefix_affinity/longest",
)  # fmt: skip
LATE_SLACK = 8
VOCAB = 4000
SYSTEM_PROMPT = 512  # tokens every session starts with


@dataclass
class Workload:
    name: str
    mean_response: float
    sigma: float
    max_tokens: int
    #: each trajectory's turns: (prompt tokens, of which new to the session, response tokens)
    run: Callable[[VirtualFleet, int], Awaitable[list[list[tuple[int, int, int]]]]]
    group_prompt: int = 0  # tokens of the prompt a GRPO group shares (0: not GRPO)
    groups: int = 0
    #: siblings' lengths unrelated: each sample draws its own from a log-normal sample of 5,000 (the sim
    #: engine otherwise draws a prompt's difficulty, so siblings' lengths are related)
    independent: bool = False


@dataclass
class Result:
    workload: str
    policy: str
    seed: int
    makespan_s: float
    bound_s: float
    busy_imbalance: float
    prefix_hit_rate: float
    prefill_tokens: int
    group_prefill: float
    preempted: int

    @property
    def vs_bound(self) -> float:
        return self.makespan_s / self.bound_s


def grpo(groups: int, samples: int, prompt_len: int, max_tokens: int):
    async def run(fleet: VirtualFleet, seed: int) -> list[list[tuple[int, int, int]]]:
        rng = random.Random(seed)
        prompts = [[rng.randrange(3, VOCAB) for _ in range(prompt_len)] for _ in range(groups)]

        async def sample(g: int, i: int) -> list[tuple[int, int, int]]:
            out = await fleet.client.generate(
                f"g{g}-s{i}", prompt_ids=prompts[g], sampling_params={"max_tokens": max_tokens, "seed": g * 1000 + i}
            )
            return [(prompt_len, prompt_len, len(out.token_ids))]

        return await asyncio.gather(*(sample(g, i) for g in range(groups) for i in range(samples)))

    return run


def sessions(count: int, turns: int, system_len: int, task_len: int, tool_len: int, max_tokens: int):
    async def run(fleet: VirtualFleet, seed: int) -> list[list[tuple[int, int, int]]]:
        rng = random.Random(seed)
        system = [rng.randrange(3, VOCAB) for _ in range(system_len)]

        async def session(s: int) -> list[tuple[int, int, int]]:
            local = random.Random(seed * 7919 + s)
            prompt = system + [local.randrange(3, VOCAB) for _ in range(task_len)]
            turns_done = []
            for t in range(turns):
                out = await fleet.client.generate(
                    f"session-{s}", prompt_ids=prompt, sampling_params={"max_tokens": max_tokens, "seed": s * 100 + t}
                )
                new = len(prompt) if t == 0 else tool_len  # what the session's own warm cache still prefills
                turns_done.append((len(prompt), new, len(out.token_ids)))
                prompt = prompt + out.token_ids + [local.randrange(3, VOCAB) for _ in range(tool_len)]
            fleet.client.finish_session(f"session-{s}")
            return turns_done

        return await asyncio.gather(*(session(s) for s in range(count)))

    return run


WORKLOADS = {
    "grpo capacity": Workload("grpo capacity", 150, 0.8, 512, grpo(256, 8, 512, 512), 512, 256),
    "grpo unrelated": Workload("grpo unrelated", 150, 0.8, 512, grpo(256, 8, 512, 512), 512, 256, independent=True),
    "grpo n16": Workload("grpo n16", 150, 0.8, 512, grpo(128, 16, 512, 512), 512, 128),
    "grpo tail": Workload("grpo tail", 300, 1.4, 2048, grpo(16, 4, 512, 2048), 512, 16),
    "sessions": Workload("sessions", 120, 1.0, 512, sessions(128, 4, SYSTEM_PROMPT, 64, 48, 512)),
}


def independent_lengths(workload: Workload, seed: int, n: int = 5000) -> list[int]:
    rng = random.Random(seed)
    mu = math.log(workload.mean_response) - workload.sigma**2 / 2
    return [max(1, int(math.exp(rng.gauss(mu, workload.sigma)))) for _ in range(n)]


def rollout_config(args: argparse.Namespace, workload: Workload, policy: str, seed: int) -> RolloutConfig:
    return RolloutConfig(
        name="sim",
        num_replicas=args.replicas,
        prompt_length=4096,
        response_length=workload.max_tokens,
        max_model_len=8192,
        routing={
            "policy": policy.split("/")[0],
            "seed": seed,
            "max_inflight_per_replica": args.max_num_seqs + args.late_slack if "/" in policy else None,
            "dispatch_order": "longest_group_first" if policy.endswith("/longest") else "fifo",
            "dispatch_lookahead": args.dispatch_lookahead,
        },
        sim=SimEngineConfig(
            vocab_size=VOCAB,
            max_num_seqs=args.max_num_seqs,
            mean_response_tokens=workload.mean_response,
            response_sigma=workload.sigma,
            cache_on_prefill=True,
            prefix_cache_blocks=args.prefix_cache_blocks,
            seed=seed,
            max_steps_per_wake=1_000_000,  # fast-forward: the same steps, far fewer wakes
            response_lengths=independent_lengths(workload, seed) if workload.independent else None,
        ),
    )


def lower_bound(
    sim: SimEngineConfig, replicas: int, trajectories: list[list[tuple[int, int, int]]], unique_prompt: int
) -> float:
    """max(longest trajectory alone, all work at full-batch throughput over every replica), in s,
    priced by the engine's own step-cost model."""
    cost = StepCost.of(sim)
    longest = max(sum(cost.prefill_ms(new) + cost.decode_ms(ctx, out) for ctx, new, out in t) for t in trajectories)
    decode = sum(cost.decode_ms(ctx, out, batch=sim.max_num_seqs) for t in trajectories for ctx, _, out in t)
    spread = (decode + cost.prefill_ms(unique_prompt)) / replicas
    return max(longest, spread) / 1000.0


async def measure(
    args: argparse.Namespace, workload: Workload, policy: str, seed: int
) -> tuple[FleetReport, Any, RolloutConfig]:
    config = rollout_config(args, workload, policy, seed)
    fleet = await VirtualFleet(config).start()
    try:
        trajectories = await workload.run(fleet, seed)
        return await fleet.report(), trajectories, config
    finally:
        await fleet.shutdown()


def one(args: argparse.Namespace, workload: Workload, policy: str, seed: int) -> Result:
    report, trajectories, config = virtual_time.run(measure(args, workload, policy, seed))
    alone = sum(new for t in trajectories for _, new, _ in t)  # prefilled with nothing shared
    if workload.groups:  # each group's prompt once
        unique = workload.groups * workload.group_prompt
    else:  # sessions: the system prompt once; each session's task, then each tool reply
        unique = alone - (len(trajectories) - 1) * SYSTEM_PROMPT
    bound = lower_bound(config.sim, config.num_replicas, trajectories, unique)
    group_prefill = report.prefill_tokens / unique if workload.groups else 0.0
    return Result(
        workload.name, policy, seed, report.makespan_s, bound, report.busy_imbalance, report.prefix_hit_rate,
        report.prefill_tokens, group_prefill, report.preempted,
    )  # fmt: skip


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--late-slack", type=int, default=LATE_SLACK, help="late binding's limit over the batch slots")
    parser.add_argument(
        "--dispatch-lookahead", type=float, default=RoutingConfig().dispatch_lookahead, help="for /longest"
    )
    parser.add_argument(
        "--prefix-cache-blocks",
        type=int,
        default=SimEngineConfig().prefix_cache_blocks,
        help="most free blocks each engine's prefix cache keeps (default: all its free KV blocks)",
    )
    parser.add_argument("--workloads", nargs="*", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--policies", nargs="*", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    console = Console(width=160)
    results: list[Result] = []
    runs = [(w, p, seed) for w in args.workloads for p in args.policies for seed in args.seeds]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("routing quality", total=len(runs))
        for name, policy, seed in runs:
            progress.update(task, description=f"{name} / {policy} / seed {seed}")
            results.append(one(args, WORKLOADS[name], policy, seed))
            progress.advance(task)
    table = Table(
        title=f"routing quality: {args.replicas} sim replicas x {args.max_num_seqs} seqs, virtual time, "
        f"mean of seeds {' '.join(map(str, args.seeds))}"
    )
    for col in ("workload", "policy", "makespan s", "vs bound (range)", "vs least_inflight", "busy imbalance",
                "prefix hit", "prefilled tokens", "group prompt prefills", "preempted"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("workload", "policy") else "right")
    summary = []
    for name in args.workloads:
        base = [r.makespan_s for r in results if r.workload == name and r.policy == "least_inflight"]
        for policy in args.policies:
            rs = [r for r in results if r.workload == name and r.policy == policy]
            ratios = [r.vs_bound for r in rs]
            # per seed, this policy's makespan over least_inflight's on the same work
            per_seed = [r.makespan_s / b for r, b in zip(rs, base)]
            row = {
                "workload": name,
                "policy": policy,
                "makespan_s": mean([r.makespan_s for r in rs]),
                "bound_s": mean([r.bound_s for r in rs]),
                "vs_bound": mean(ratios),
                "vs_bound_min": min(ratios),
                "vs_bound_max": max(ratios),
                "vs_least_inflight": mean(per_seed) if base else None,
                "vs_least_inflight_min": min(per_seed) if base else None,
                "vs_least_inflight_max": max(per_seed) if base else None,
                "busy_imbalance": mean([r.busy_imbalance for r in rs]),
                "prefix_hit_rate": mean([r.prefix_hit_rate for r in rs]),
                "prefill_tokens": mean([r.prefill_tokens for r in rs]),
                "group_prefill": mean([r.group_prefill for r in rs]),
                "preempted": sum(r.preempted for r in rs),
            }
            summary.append(row)
            vs_li = row["vs_least_inflight"]
            table.add_row(
                name, policy, f"{row['makespan_s']:.2f}",
                f"{row['vs_bound']:.3f}x ({row['vs_bound_min']:.3f}-{row['vs_bound_max']:.3f})",
                f"{vs_li:.3f}x ({row['vs_least_inflight_min']:.3f}-{row['vs_least_inflight_max']:.3f})"
                if vs_li is not None else "-",
                f"{row['busy_imbalance']:.2f}",
                f"{row['prefix_hit_rate']:.1%}", f"{row['prefill_tokens']:,.0f}",
                f"{row['group_prefill']:.2f}x" if row["group_prefill"] else "-", str(row["preempted"]),
            )  # fmt: skip
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": {k: v for k, v in vars(args).items() if k != "json"},
                    "summary": summary,
                    "runs": [asdict(r) | {"vs_bound": r.vs_bound} for r in results],
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
