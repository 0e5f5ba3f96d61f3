"""Which split of one of verl's fully-async rows would train fastest, by the plan of it.

verl ran its fully-async rows half and half (16:16, 32:32, 64:64 H20s). With the same inputs as
``benchmarks/verl_fully_async.py`` (``rollfleet.plan.verl_table``: verl's setup, the learner
fitted to verl's training columns, the assumed response lengths), this plans the row's
``separate_async`` at other splits too: the learner costs ``a + b / gpus`` on the accelerators
left to it, the rollouter keeps 16 prompts in flight per server that generates. Beside each: the
row's planned colocated ``sync`` (on all of them) and verl's own step at its split.

A prediction, not a measurement: verl timed one split per row. The learner's fit spans 16 to 64
accelerators (a split outside that extrapolates it), and the 32-GPU row is the one the plan does
not reproduce (see the README).

Run: ``python benchmarks/verl_splits.py`` (the 64-GPU row; ``--row 32|64|128``, ``--shares``);
``--json F`` and ``--png F`` write the numbers and a plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rollfleet.plan.planner import PlanSpec, run_plans
from rollfleet.plan.verl_table import ASYNC_LOCAL_STEPS, VERL_ROWS, learner_fits, row_specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", type=int, default=64, choices=[r.gpus for r in VERL_ROWS], help="verl's row (GPUs)")
    parser.add_argument(
        "--shares", default="0.375,0.4375,0.5,0.5625,0.625,0.75", help="rollout shares of the accelerators"
    )
    parser.add_argument("--scale", type=float, default=1.0, help="accelerators and prompts per step, of verl's")
    parser.add_argument("--steps", type=int, default=4, help="512-prompt steps per plan (the first left out)")
    parser.add_argument("--seeds", default="0", help="comma-separated; results are means over them")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="runs/verl_splits", help="the plans' run folders")
    parser.add_argument("--json", help="write the numbers here")
    parser.add_argument("--png", help="plot each split's step beside sync's and verl's here")
    args = parser.parse_args()
    console = Console(width=160)
    row = next(r for r in VERL_ROWS if r.gpus == args.row)
    shares = [float(s) for s in args.shares.split(",")]
    seeds = tuple(int(s) for s in args.seeds.split(","))
    fits = learner_fits()
    common: dict[str, Any] = {"scale": args.scale, "steps": args.steps, "seeds": seeds, "fits": fits}
    specs: dict[str, PlanSpec] = {"sync": row_specs(row, output_dir=args.out, **common)["sync"]}
    for share in shares:  # each split its own folder: the runs are named by mode and seed only
        specs[f"{share:g}"] = row_specs(row, output_dir=f"{args.out}/{share:g}", rollout_share=share, **common)[
            "separate_async"
        ]
    splits = [spec.gpus_of("separate_async") for key, spec in specs.items() if key != "sync"]
    if len(set(splits)) < len(splits):
        raise SystemExit(f"--shares {args.shares} give the same split twice in whole tp-4 replicas: {splits}")
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"planning verl's {row.gpus}-GPU row", total=len(specs) * len(seeds))
        plans = run_plans(list(specs.values()), on_run=lambda r: progress.update(task, advance=1), workers=args.workers)
    results = dict(zip(specs, plans))
    sync_step = statistics.fmean(r.step_s for r in results.pop("sync").runs)

    rows = []
    for key, plan in results.items():
        generating, training = plan.spec.gpus_of("separate_async")
        runs = plan.runs
        step = statistics.fmean(r.step_s for r in runs) * ASYNC_LOCAL_STEPS
        rows.append(
            {
                "rollout_share": float(key),
                "split": f"{generating}:{training}",
                "async_step": step,
                "speedup_vs_sync": sync_step / step,
                "trainer_idle": statistics.fmean(r.trainer_idle for r in runs),
                "fleet_idle": statistics.fmean(r.fleet_idle for r in runs),
                "dropped_groups": statistics.fmean(r.dropped_groups for r in runs),
                "learner_s": fits["separate_async"].seconds(training / args.scale),  # fitted at verl's size
            }
        )
    best = min(rows, key=lambda r: r["async_step"])
    # a split within 1% of the fastest ties with it: seeds move a plan's step by about that much
    ties = [r["split"] for r in rows if r is not best and r["async_step"] <= 1.01 * best["async_step"]]
    gpus = round(row.gpus * args.scale)
    half = f"{gpus // 2}:{gpus // 2}"
    table = Table(
        title=f"verl's {row.gpus}-GPU row, separate_async by split (plan, scale {args.scale:g}, seeds {args.seeds}; "
        f"s per 512 x 16 samples); planned sync on all {gpus}: {sync_step:.0f} s, verl's {half}: "
        f"{row.async_step:.0f} s"
    )
    for col in ("split (generating:training)", "async step", "speed-up vs sync", "learner alone (fit)",
                "trainer idle", "fleet idle", "dropped groups"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        mark = " (fastest)" if r is best else " (within 1%)" if r["split"] in ties else ""
        table.add_row(
            r["split"] + (" (verl's)" if r["split"] == half else ""),
            f"{r['async_step']:.0f}{mark}",
            f"{r['speedup_vs_sync']:.2f}x",
            f"{r['learner_s']:.0f}",
            f"{r['trainer_idle']:.0%}",
            f"{r['fleet_idle']:.0%}",
            f"{r['dropped_groups']:.1f}",
        )
    console.print(table)
    doc = {
        "row": row.gpus,
        "gpus": gpus,
        "scale": args.scale,
        "steps": args.steps,
        "seeds": list(seeds),
        "sync_step": sync_step,
        "verl": {"split": half, "async_step": row.async_step, "sync_step": row.sync_step},
        "splits": rows,
        "fastest": best["split"],
        "within_1pct_of_fastest": ties,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    if args.png:
        _plot(doc, args.png)


def _plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["splits"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [r["split"] for r in rows]
    ax.bar(labels, [r["async_step"] for r in rows], color="#4c72b0", label="plan: separate_async")
    ax.bar(labels, [r["learner_s"] for r in rows], color="#c6d4ea", width=0.4, label="its learner alone (fit)")
    ax.axhline(doc["sync_step"], color="#c44e52", linestyle="--", label=f"plan: sync on all {doc['gpus']}")
    verl = doc["verl"]
    if verl["split"] in labels:
        ax.plot([labels.index(verl["split"])], [verl["async_step"]], "k*", markersize=12, label="verl (published)")
    ax.set_xlabel("accelerators generating : training")
    ax.set_ylabel("seconds per 512 x 16 samples")
    ties = doc["within_1pct_of_fastest"]
    tied = f"; {', '.join(ties)} within 1%" if ties else ""
    ax.set_title(f"verl's {doc['row']}-GPU row by split (fastest: {doc['fastest']}{tied})")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
