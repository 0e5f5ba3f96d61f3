"""How long ``rollfleet plan`` takes to plan a large cluster, on this host's CPUs.

Side by side in one run: the same plan (``--gpus`` accelerators, ``--steps`` training steps of
``sync``) with the sim engine stepping one step at a time (``max_steps_per_wake: 1``, every engine
step a timer and a token at a time) and fast-forwarding (what ``rollfleet plan`` does: the steps up
to the next event at once, tokens produced when a request ends). The two must give the same plan;
the ratio of their wall times is the speed-up. Then every mode for ``--full-steps`` steps with the
fast-forward, timed, in one process and spread over ``--workers`` processes (as ``rollfleet plan``
does by default, the longest runs started first), then spread again with the runs started in the
order given: what a user waits for a plan of that size; all must give the same plan.

Workload (a GRPO step of 128 prompts x 8 samples): 256-token prompts, log-normal responses (mean
400 tokens, sigma 0.8) up to 2,048, the sim engine's 7B-class step costs, a learner of 1e-5 s per
token. Wall times depend on the host (2 shared cores here); the plans themselves do not.

Run: ``python benchmarks/plan_speed.py`` (``--full-steps 0`` skips the long runs); ``--json FILE``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from rollfleet.config import RollfleetConfig, load_config
from rollfleet.models.vocab import fit_sim_to_model
from rollfleet.plan.planner import MODES, ModeRun, PlanSpec, run_plan

WORKLOAD = {
    "rollout.name": "sim",
    "rollout.n": 8,
    "rollout.prompt_length": 256,
    "rollout.response_length": 2048,
    "rollout.max_model_len": 2400,
    "rollout.sim.mean_response_tokens": 400,
    "rollout.sim.response_sigma": 0.8,
    "agent.num_workers": 4,
    "trainer.train_batch_size": 128,
    "trainer.parameter_sync_step": 1,
    "trainer.max_off_policy_steps": 2,
    "trainer.max_inflight_groups": 256,
    "trainer.max_queue_groups": 256,
    "trainer.sim_learner.seconds_per_token": 1e-5,
}


def config(steps: int, steps_per_wake: int | None, **extra: Any) -> RollfleetConfig:
    """The workload for ``steps`` steps; ``extra``: dotted overrides on top of it."""
    overrides: dict[str, Any] = {**WORKLOAD, "trainer.total_steps": steps, **extra}
    if steps_per_wake is not None:
        overrides["rollout.sim.max_steps_per_wake"] = steps_per_wake
    return fit_sim_to_model(load_config(None, overrides))


def timed(
    spec: PlanSpec, workers: int = 1, longest_first: bool = True
) -> tuple[float, list[ModeRun], dict[str, float]]:
    """The plan's wall time, its runs, and when each run finished (s from the start; in one
    process, one after another, so the differences are each run's own wall time)."""
    start = time.perf_counter()
    finished: dict[str, float] = {}
    result = run_plan(
        spec,
        on_run=lambda r: finished.setdefault(r.mode, time.perf_counter() - start),
        workers=workers,
        longest_first=longest_first,
    )
    return time.perf_counter() - start, result.runs, finished


def plan_numbers(run: ModeRun) -> tuple:
    """What a plan reports, to 9 significant digits (the two loops sum step costs in another order)."""
    values = (run.step_s, run.trainer_idle, run.fleet_idle, run.cluster_idle, run.tokens_per_s, run.staleness_mean)
    return tuple(float(f"{v:.9g}") for v in values) + (run.staleness_max, run.dropped_groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6, help="steps of the side-by-side sync plans")
    parser.add_argument("--full-steps", type=int, default=100, help="steps of the timed plan of every mode")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--workers", type=int, default=2, help="processes for the timed plan of every mode (also run with 1)"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    console = Console(width=150)
    out: dict[str, Any] = {"gpus": args.gpus, "workload": WORKLOAD}

    # A throwaway plan first: the first plan in a process pays its lazy imports (torch among them,
    # about 1.3 s here), which charged the side timed first with them.
    run_plan(PlanSpec(config(2, None), gpus=4, modes=("sync",), seeds=(0,), output_dir="runs/plan_speed_warmup"))
    side = {}
    for label, per_wake in (("one step at a time", 1), ("fast-forward", None)):
        console.print(f"[bold]{label}[/]: sync, {args.gpus} accelerators, {args.steps} steps ...")
        spec = PlanSpec(
            config(args.steps, per_wake), gpus=args.gpus, modes=("sync",), seeds=(0,), output_dir="runs/plan_speed"
        )
        wall, runs, _ = timed(spec)
        side[label] = {"wall_s": wall, "wall_s_per_step": wall / args.steps, "run": asdict(runs[0])}
    slow, fast = side["one step at a time"], side["fast-forward"]
    same = plan_numbers(ModeRun(**slow["run"])) == plan_numbers(ModeRun(**fast["run"]))
    out["side_by_side"] = {**side, "speedup": slow["wall_s"] / fast["wall_s"], "same_plan": same}
    table = Table(
        title=f"rollfleet plan wall time: sync, {args.gpus} accelerators, {args.steps} steps, 1,024 responses a step"
    )
    for col in ("engine loop", "wall s", "wall s / step", "planned s / step", "planned tokens/s"):
        table.add_column(col, justify="left" if col == "engine loop" else "right")
    for label, row in side.items():
        run = row["run"]
        table.add_row(
            label,
            f"{row['wall_s']:.1f}",
            f"{row['wall_s_per_step']:.2f}",
            f"{run['step_s']:.3f}",
            f"{run['tokens_per_s']:,.0f}",
        )
    console.print(table)
    console.print(f"fast-forward: {out['side_by_side']['speedup']:.2f}x faster; same plan: {same}")

    if args.full_steps:
        # The whole plan a user waits for: every mode, in this process, then spread over processes.
        modes = tuple(args.modes.split(","))
        full: dict[str, Any] = {}
        ways = [("1", 1, True)]
        if args.workers > 1:  # the runs started longest first (the default), and in the order given
            ways += [(str(args.workers), args.workers, True), (f"{args.workers}, in order", args.workers, False)]
        for label, workers, longest_first in ways:
            console.print(f"[bold]{', '.join(modes)}[/]: {args.full_steps} steps, {label} worker(s) ...")
            spec = PlanSpec(
                config(args.full_steps, None), gpus=args.gpus, modes=modes, seeds=(0,), output_dir="runs/plan_speed"
            )
            wall, runs, finished = timed(spec, workers, longest_first)
            full[label] = {"wall_s": wall, "finished_s": finished, "runs": [asdict(r) for r in runs]}
            console.print("  runs finished at " + ", ".join(f"{m} {s:.1f} s" for m, s in finished.items()))
        table = Table(
            title=f"rollfleet plan, every mode: {args.gpus} accelerators, {args.full_steps} steps, fast-forward"
        )
        table.add_column("workers")
        table.add_column("wall s", justify="right")
        for mode in modes:
            table.add_column(f"{mode} s / step (planned)", justify="right")
        for workers, row in full.items():
            table.add_row(workers, f"{row['wall_s']:.1f}", *(f"{r['step_s']:.3f}" for r in row["runs"]))
        console.print(table)
        plans = [[plan_numbers(ModeRun(**r)) for r in row["runs"]] for row in full.values()]
        out["full"] = {
            "steps": args.full_steps,
            "by_workers": full,
            "same_plan": all(p == plans[0] for p in plans),
            "speedup": full["1"]["wall_s"] / full[str(args.workers)]["wall_s"],
        }
        if f"{args.workers}, in order" in full:
            out["full"]["longest_first_speedup"] = (
                full[f"{args.workers}, in order"]["wall_s"] / full[str(args.workers)]["wall_s"]
            )
        console.print(
            f"{args.workers} workers: {out['full']['speedup']:.2f}x faster; same plan: {out['full']['same_plan']}"
        )
        if "longest_first_speedup" in out["full"]:
            console.print(f"longest runs first: {out['full']['longest_first_speedup']:.2f}x faster than in order")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
