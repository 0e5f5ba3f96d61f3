"""verl's fully-async table beside rollfleet's plan of it, in one command.

For each of verl's rows (32, 64 and 128 H20s; ``rollfleet.plan.verl_table``) this plans colocated
``sync`` on all of the accelerators and ``separate_async`` on them split in half, in virtual time,
and prints verl's numbers beside the plan's: step times, the speed-up of async over sync, and the
async trainer's idle share. The issue's targets: speed-up within 15% of verl's, trainer idle
within 10 points, on every row. What the plans take from verl, what they fit to verl's training
columns and what they assume is in ``rollfleet/plan/verl_table.py``; the assumptions are flags.

Run: ``python benchmarks/verl_fully_async.py`` (twelve plans, three rows x two modes x two seeds,
at verl's size, on two processes: under 5 minutes here; ``--scale 0.25``, a quarter of the
accelerators and prompts: 76 s); ``--json F`` and ``--png F`` write the numbers and a plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rollfleet.plan.planner import ModeRun, run_plans
from rollfleet.plan.verl_table import ASYNC_LOCAL_STEPS, VERL_ROWS, Assumed, learner_fits, row_specs

SPEEDUP_TOLERANCE = 0.15
IDLE_TOLERANCE = 0.10


def _mean(runs: list[ModeRun], key: str) -> float:
    return statistics.fmean(getattr(r, key) for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Assumed()
    parser.add_argument("--scale", type=float, default=1.0, help="accelerators and prompts per step, of verl's")
    parser.add_argument("--steps", type=int, default=4, help="512-prompt steps per plan (the first left out)")
    parser.add_argument("--seeds", default="0,1", help="comma-separated; results are means over them")
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens, help="assumed")
    parser.add_argument("--mean-response", type=float, default=defaults.mean_response_tokens, help="assumed")
    parser.add_argument("--sigma", type=float, default=defaults.response_sigma, help="assumed: log-normal sigma")
    parser.add_argument(
        "--weight-load-ms", type=float, default=defaults.weight_load_ms, help="assumed: a weight sync's stall"
    )
    parser.add_argument(
        "--strategy",
        default="drop",
        choices=("drop", "wait", "mask"),
        help="the async plans' trainer.max_off_policy_strategy",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="runs/verl_table", help="the plans' run folders")
    parser.add_argument("--json", help="write the numbers here")
    parser.add_argument("--png", help="plot verl's and the plan's speed-ups and idle shares here")
    args = parser.parse_args()
    console = Console(width=200)
    assumed = Assumed(args.prompt_tokens, args.mean_response, args.sigma, args.weight_load_ms)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    fits = learner_fits()
    jobs = {
        (row.gpus, mode): spec
        for row in VERL_ROWS
        for mode, spec in row_specs(
            row,
            assumed,
            scale=args.scale,
            steps=args.steps,
            seeds=seeds,
            output_dir=args.out,
            fits=fits,
            strategy=args.strategy,
        ).items()
    }
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning verl's rows", total=len(jobs) * len(seeds))
        # one pool for every row's runs, the longest first
        plans = run_plans(
            list(jobs.values()),
            on_run=lambda r: progress.update(
                task, advance=1, description=f"{r.mode} on {r.replicas} replicas, seed {r.seed} done"
            ),
            workers=args.workers,
        )
    results: dict[tuple[int, str], list[ModeRun]] = {key: plan.runs for key, plan in zip(jobs, plans)}

    rows: list[dict[str, Any]] = []
    for row in VERL_ROWS:
        sync, asyn = results[(row.gpus, "sync")], results[(row.gpus, "separate_async")]
        sync_step = _mean(sync, "step_s")
        async_step = _mean(asyn, "step_s") * ASYNC_LOCAL_STEPS
        speedup = sync_step / async_step
        idle = _mean(asyn, "trainer_idle")
        speedup_error = speedup / row.speedup - 1
        rows.append(
            {
                "gpus": row.gpus,
                "verl": {
                    "sync_step": row.sync_step,
                    "sync_gen": row.sync_gen,
                    "async_step": row.async_step,
                    "speedup": row.speedup,
                    "speedup_100": row.speedup_100,
                    "trainer_idle": row.trainer_idle,
                    "sync_windows": row.window_steps("sync"),
                    "async_windows": row.window_steps("async"),
                },
                "plan": {
                    "sync_step": sync_step,
                    "sync_gen": sync_step * _mean(sync, "trainer_idle"),
                    "async_step": async_step,
                    "speedup": speedup,
                    "trainer_idle": idle,
                    "async_fleet_idle": _mean(asyn, "fleet_idle"),
                    "staleness_mean": _mean(asyn, "staleness_mean"),
                    "dropped_groups": sum(r.dropped_groups for r in asyn),
                },
                "speedup_error": speedup_error,
                "idle_error_points": 100 * (idle - row.trainer_idle),
                "within": abs(speedup_error) <= SPEEDUP_TOLERANCE and abs(idle - row.trainer_idle) <= IDLE_TOLERANCE,
            }
        )

    table = Table(
        title=f"verl's fully-async table (H20, Qwen2.5-Math-7B) beside rollfleet's plan "
        f"(scale {args.scale:g}, seeds {args.seeds}; seconds per 512 x 16 samples)"
    )
    for col in (
        "GPUs",
        "sync step verl / plan",
        "sync gen verl / plan",
        "async step verl / plan",
        "speed-up verl / plan (error)",
        "verl's first 100 steps (plan's error)",
        "trainer idle verl / plan",
        "within 15% / 10 pts",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        v, p = r["verl"], r["plan"]
        table.add_row(
            str(r["gpus"]),
            f"{v['sync_step']:.0f} / {p['sync_step']:.0f}",
            f"{v['sync_gen']:.0f} / {p['sync_gen']:.0f}",
            f"{v['async_step']:.0f} / {p['async_step']:.0f}",
            f"{v['speedup']:.2f}x / {p['speedup']:.2f}x ({r['speedup_error']:+.0%})",
            f"{v['speedup_100']:.2f}x ({p['speedup'] / v['speedup_100'] - 1:+.0%})",
            f"{v['trainer_idle']:.0%} / {p['trainer_idle']:.0%}",
            "yes" if r["within"] else "no",
        )
    console.print(table)
    console.print(_windows_table(rows))
    console.print(
        "learner fitted to verl's columns (a + b / GPUs, s): "
        + ", ".join(f"{m} a={f.a:.1f} b={f.b:,.0f}" for m, f in fits.items())
    )
    console.print(f"assumed: {assumed}")
    doc = {
        "scale": args.scale,
        "steps": args.steps,
        "seeds": list(seeds),
        "assumed": vars(assumed),
        "learner_fits": {m: vars(f) for m, f in fits.items()},
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    if args.png:
        _plot(rows, args.png)


def _windows_table(rows: list[dict[str, Any]]) -> Table:
    """verl's seconds per step in each 100-step window of its runs (from the published total
    times) beside the plan's: a plan of one workload against runs that may not have stayed one."""
    table = Table(title="verl's runs per 100-step window (s per step, from its total times) beside the plan's step")
    for col in (
        "GPUs",
        "sync: verl by window | plan",
        "async: verl by window | plan",
        "speed-up: verl by window | plan",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        v, p = r["verl"], r["plan"]
        speedups = [a / b for a, b in zip(v["sync_windows"], v["async_windows"])]
        table.add_row(
            str(r["gpus"]),
            f"{' / '.join(f'{x:.0f}' for x in v['sync_windows'])} | {p['sync_step']:.0f}",
            f"{' / '.join(f'{x:.0f}' for x in v['async_windows'])} | {p['async_step']:.0f}",
            f"{' / '.join(f'{x:.2f}x' for x in speedups)} | {p['speedup']:.2f}x",
        )
    return table


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['gpus']} GPUs" for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in ((ax1, "speedup", "async over sync"), (ax2, "trainer_idle", "async trainer idle")):
        ax.bar(
            [i - 0.2 for i in x], [r["verl"][key] for r in rows], width=0.4, label="verl (published)", color="#8c8c8c"
        )
        ax.bar([i + 0.2 for i in x], [r["plan"][key] for r in rows], width=0.4, label="rollfleet plan", color="#4c72b0")
        ax.set_xticks(list(x), labels)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    ax1.errorbar(
        [i - 0.2 for i in x],
        [r["verl"]["speedup"] for r in rows],
        yerr=[SPEEDUP_TOLERANCE * r["verl"]["speedup"] for r in rows],
        fmt="none",
        ecolor="black",
        capsize=4,
        label="target: within 15%",
    )
    ax1.legend(fontsize=8)
    ax2.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
