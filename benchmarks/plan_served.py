"""What each trainer mode, and each staleness strategy of ``separate_async``, serves for what it trains.

A plan's step time alone can flatter a mode: ``separate_async`` with the default ``drop`` strategy
throws away the groups that went stale, and the long ones go stale first, so its learner trains
fewer tokens a step. This runs ``benchmarks/plan_speed.py``'s workload (``--gpus`` accelerators,
128 GRPO groups x 8 samples a step, ``--steps`` steps, seed 0) for every mode with the default
``drop``, then ``separate_async`` with ``wait`` and ``mask``, all on one pool of processes, and
prints per run: the step time, the trained tokens per second, tokens generated per token trained,
requests per trained sample, dropped groups and staleness. Plans are the same on any host.

Run: ``python benchmarks/plan_served.py`` (``--json FILE``; ``--steps 20`` for a quick look).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from plan_speed import WORKLOAD, config
from rich.console import Console
from rich.table import Table

from rollfleet.plan.planner import MODES, PlanSpec, run_plans

STRATEGIES = ("drop", "wait", "mask")


def spec(strategy: str, modes: tuple[str, ...], steps: int, gpus: int) -> PlanSpec:
    cfg = config(steps, None, **{"trainer.max_off_policy_strategy": strategy})
    return PlanSpec(cfg, gpus=gpus, modes=modes, seeds=(0,), output_dir=f"runs/plan_served/{strategy}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    console = Console(width=150)

    specs = [spec("drop", MODES, args.steps, args.gpus)]
    specs += [spec(s, ("separate_async",), args.steps, args.gpus) for s in STRATEGIES[1:]]
    console.print(
        f"{args.gpus} accelerators, {args.steps} steps: 3 modes with drop, separate_async with wait and mask ..."
    )
    with console.status("planning"):
        results = run_plans(specs, workers=args.workers)

    table = Table(
        title=f"what each run served for what it trained ({args.gpus} accelerators, {args.steps} steps, seed 0)"
    )
    for col in (
        "mode",
        "strategy",
        "s / step",
        "trained tokens/s",
        "generated / trained",
        "requests / sample",
        "dropped groups",
        "staleness mean / max",
    ):
        table.add_column(col, justify="left" if col in ("mode", "strategy") else "right")
    rows = []
    for strategy, result in zip(STRATEGIES, results):
        for run in result.runs:
            rows.append({"strategy": strategy, **asdict(run)})
            table.add_row(
                run.mode,
                strategy,
                f"{run.step_s:.2f}",
                f"{run.tokens_per_s:,.0f}",
                f"{run.generated_per_trained:.2f}x",
                f"{run.requests_per_sample:.2f}",
                str(run.dropped_groups),
                f"{run.staleness_mean:.2f} / {run.staleness_max}",
            )
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpus": args.gpus, "steps": args.steps, "workload": WORKLOAD, "runs": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
