"""``rollfleet simulate``: an agentic rollout over a simulated fleet, with weight updates mid-way.

Runs ``--sessions`` multi-turn sessions (each turn appends the model's answer and a "tool" reply
to the prompt, so later turns share a growing prefix) through ``FullyAsyncLLMServerClient`` on an
embedded Ray cluster, fires weight updates while they are in flight, and prints throughput, the
prefix-cache hit rate, the load balance across replicas (in requests, and in engine busy time:
equal request counts can hide unequal work) and how many requests were resumed.

``--virtual``: the same rollout on a :class:`rollfleet.plan.VirtualFleet` (no Ray; the real
replica, client and routing code) in virtual time: times are simulated seconds, and a run repeats
exactly on any host.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.config import RollfleetConfig
from rollfleet.manager import LLMServerManager
from rollfleet.plan import VirtualFleet


@dataclass
class SimulateOptions:
    sessions: int = 300
    turns: int = 3
    prompt_tokens: int = 256
    tool_tokens: int = 48
    max_tokens_per_turn: int = 256
    #: Updates fired while the rollout runs, evenly by progress: with 3, when a quarter, half and
    #: three quarters of the sessions are done (by progress, not by the clock: a faster fleet
    #: must not finish before the updates it is meant to ride out).
    weight_updates: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("sessions", 1), ("turns", 1), ("prompt_tokens", 1), ("tool_tokens", 0),
                          ("max_tokens_per_turn", 1), ("weight_updates", 0)):  # fmt: skip
            value = getattr(self, name)
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if self.weight_updates >= self.sessions and self.weight_updates:
            raise ValueError(
                f"weight_updates must be < sessions ({self.sessions}): each fires while sessions still run, "
                f"got {self.weight_updates}"
            )


@dataclass
class SimulateResult:
    wall_s: float
    trajectories: int
    requests: int
    output_tokens: int
    resumes: int
    cache_hit_rate: float
    per_replica_requests: dict[str, int] = field(default_factory=dict)
    #: simulated seconds each replica's engine spent in steps (sim engines report it)
    per_replica_busy_s: dict[str, float] = field(default_factory=dict)
    sticky_kept: float = 0.0
    weight_updates: list[dict[str, Any]] = field(default_factory=list)
    max_version_span: int = 0
    decisions: dict[str, int] = field(default_factory=dict)

    @property
    def imbalance(self) -> float:
        return _max_over_mean(list(self.per_replica_requests.values()))

    @property
    def busy_imbalance(self) -> float:
        """The busiest engine's busy time over the mean: what decides when a rollout ends."""
        return _max_over_mean(list(self.per_replica_busy_s.values()))


def _max_over_mean(values: list[float] | list[int]) -> float:
    return max(values) / (sum(values) / len(values)) if values and sum(values) else 1.0


async def _session(
    client: FullyAsyncLLMServerClient, sid: int, opts: SimulateOptions, vocab: int, rng: random.Random
) -> dict:
    prompt = [rng.randrange(3, vocab) for _ in range(opts.prompt_tokens + rng.randrange(opts.prompt_tokens))]
    replicas, resumes, out_tokens, versions = [], 0, 0, []
    for _turn in range(opts.turns):
        out = await client.generate(
            f"session-{sid}",
            prompt_ids=prompt,
            sampling_params={"temperature": 1.0, "max_tokens": opts.max_tokens_per_turn},
        )
        replicas.append(out.extra_fields.get("replica_id"))
        resumes += out.extra_fields.get("num_resumes", 0)
        out_tokens += len(out.token_ids)
        versions.append((out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]))
        tool_reply = [rng.randrange(3, vocab) for _ in range(opts.tool_tokens)]
        prompt = prompt + out.token_ids + tool_reply
    client.finish_session(f"session-{sid}")
    return {"replicas": replicas, "resumes": resumes, "tokens": out_tokens, "versions": versions}


def context_needed(opts: SimulateOptions) -> int:
    """The longest context a session may reach: its prompt (up to twice ``prompt_tokens``) and
    every turn's reply and tool result."""
    return opts.prompt_tokens * 2 + opts.turns * (opts.max_tokens_per_turn + opts.tool_tokens)


def fit_context(config: RollfleetConfig, opts: SimulateOptions) -> RollfleetConfig:
    """``config`` with ``rollout.max_model_len`` raised to :func:`context_needed` where it is
    shorter: what the replicas start with, so what a check before the run must see."""
    cfg = config.rollout
    assert cfg.max_model_len is not None  # RolloutConfig's validator fills it in (prompt + response length)
    if cfg.max_model_len >= context_needed(opts):
        return config
    return config.model_copy(update={"rollout": cfg.model_copy(update={"max_model_len": context_needed(opts)})})


async def run_simulation(
    config: RollfleetConfig, opts: SimulateOptions, console: Optional[Console] = None, *, virtual: bool = False
) -> SimulateResult:
    """The rollout on a fleet on Ray, or with ``virtual`` on a :class:`VirtualFleet`: run it then
    under :func:`rollfleet.utils.virtual_time.run`, and ``wall_s`` is simulated seconds."""
    console = console or Console()
    config = fit_context(config, opts)
    cfg = config.rollout
    if virtual and cfg.routing.seed is None:  # a virtual rollout repeats exactly: policies' ties too
        cfg = cfg.model_copy(update={"routing": cfg.routing.model_copy(update={"seed": opts.seed})})
        config = config.model_copy(update={"rollout": cfg})
    manager: Any = await (VirtualFleet.create(config) if virtual else LLMServerManager.create(config))
    clock = asyncio.get_running_loop().time  # virtual on a virtual-time loop, monotonic otherwise
    try:
        client = manager.get_client(FullyAsyncLLMServerClient)
        rng = random.Random(opts.seed)
        before = await manager.replica_stats()
        updates: list[dict[str, Any]] = []
        start = clock()
        with Progress(
            TextColumn("[bold]rollout"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            transient=False,
        ) as progress:
            task = progress.add_task("sessions", total=opts.sessions, info="")
            done: list[dict] = []

            async def tracked(i: int) -> None:
                done.append(await _session(client, i, opts, cfg.sim.vocab_size, random.Random(rng.random())))
                progress.update(task, advance=1, info=f"weights v{len(updates)}")

            sessions = [asyncio.ensure_future(tracked(i)) for i in range(opts.sessions)]
            for finished, session in enumerate(asyncio.as_completed(sessions), 1):
                await session
                # Each update fires once its share of sessions is done, while sessions still run.
                # ``finished`` counts the sessions seen here: ``done`` may already hold more, ended
                # in the same instant, and asking it would skip updates that were due.
                while finished < opts.sessions and len(updates) < opts.weight_updates:
                    version = len(updates) + 1
                    if finished < opts.sessions * version / (opts.weight_updates + 1):
                        break
                    updates.append(await manager.update_weights({"step": version}, version))
        wall = clock() - start
        after = await manager.replica_stats()
        per_replica = {rid: after[rid]["requests"] - before.get(rid, {}).get("requests", 0) for rid in after}
        busy = {
            rid: float(after[rid]["sim_busy_s"]) - float(before.get(rid, {}).get("sim_busy_s", 0.0))
            for rid in after
            if "sim_busy_s" in after[rid]
        }
        hit = sum(
            after[r]["prefix_cache_hit_tokens"] - before.get(r, {}).get("prefix_cache_hit_tokens", 0) for r in after
        )
        query = sum(
            after[r]["prefix_cache_query_tokens"] - before.get(r, {}).get("prefix_cache_query_tokens", 0) for r in after
        )
        kept = sum(1 for d in done if len(set(d["replicas"])) == 1)
        return SimulateResult(
            wall_s=wall,
            trajectories=len(done),
            requests=len(done) * opts.turns,
            output_tokens=sum(d["tokens"] for d in done),
            resumes=sum(d["resumes"] for d in done),
            cache_hit_rate=hit / query if query else 0.0,
            per_replica_requests=per_replica,
            per_replica_busy_s=busy,
            sticky_kept=kept / len(done) if done else 0.0,
            weight_updates=updates,
            max_version_span=max((v[-1][1] - v[0][0] for v in (d["versions"] for d in done)), default=0),
            decisions=dict(client.get_status()["decisions"]),
        )
    finally:
        await manager.shutdown()


def render(result: SimulateResult, console: Console, *, virtual: bool = False) -> None:
    """The summary table; with ``virtual``, times are simulated seconds."""
    clock = "simulated" if virtual else "wall"
    table = Table(title="rollfleet simulate: summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("trajectories completed", f"{result.trajectories}")
    table.add_row("requests (turns)", f"{result.requests}")
    table.add_row(f"{clock} time", f"{result.wall_s:.2f} s")
    if result.wall_s > 0:  # engines whose steps cost nothing end a virtual run at 0 s
        table.add_row("throughput", f"{result.output_tokens / result.wall_s:,.0f} output tokens/s ({clock})")
        table.add_row("requests/s", f"{result.requests / result.wall_s:,.1f}")
    else:
        table.add_row("throughput", f"- (no {clock} time passed)")
    table.add_row("prefix-cache hit rate", f"{result.cache_hit_rate:.1%}")
    table.add_row("sessions kept on one replica", f"{result.sticky_kept:.1%}")
    table.add_row("load balance (max/mean requests)", f"{result.imbalance:.3f}")
    if result.per_replica_busy_s:
        table.add_row("engine busy time (max/mean)", f"{result.busy_imbalance:.3f}")
    table.add_row("weight updates during rollout", f"{len(result.weight_updates)}")
    if result.weight_updates:
        pauses = [u["pause_s"] * 1000 for u in result.weight_updates]  # the commits: staging did not pause it
        table.add_row("weight-update pause (mean)", f"{sum(pauses) / len(pauses):.1f} ms")
    table.add_row("aborted-and-resumed attempts", f"{result.resumes}")
    table.add_row("routing decisions", ", ".join(f"{k}={v}" for k, v in sorted(result.decisions.items())))
    table.add_row("per-replica requests", ", ".join(f"{k}={v}" for k, v in sorted(result.per_replica_requests.items())))
    console.print(table)
