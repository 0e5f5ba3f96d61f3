"""``rollfleet train``: RL training on the fleet, with a live progress display, metrics.jsonl
and PNG plots under ``runs/<run_name>/``."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollfleet.config import RollfleetConfig


async def run_training(config: RollfleetConfig, console: Console) -> dict[str, Any]:
    from rollfleet.trainer import get_trainer_cls
    from rollfleet.trainer.plots import plot_run

    cls = get_trainer_cls(config.trainer.trainer_mode)
    with Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
    ) as progress:
        total = int(config.trainer.model_dump().get("total_steps", 20))
        task = progress.add_task("steps", total=total, info="starting the fleet...")

        def on_step(row: dict[str, Any]) -> None:
            progress.update(
                task,
                completed=row["step"],
                info=(
                    f"reward {row.get('reward/mean', 0):.3f} | {row.get('perf/tokens_per_s', 0):,.0f} tok/s | "
                    f"staleness {row.get('staleness/mean', 0):.2f} (max {row.get('staleness/max', 0)}) | "
                    f"syncs {row.get('syncs', 0)} | idle {row.get('idle_frac', 0):.0%}"
                ),
            )

        trainer = cls(config, progress=on_step)
        try:
            await trainer.init()
            progress.update(task, completed=trainer.step, info="training")
            summary = await trainer.fit()
        finally:
            await trainer.close()
    summary["plots"] = [str(p) for p in plot_run(trainer.run_dir)]
    return summary


def render_summary(summary: dict[str, Any], console: Console) -> None:
    table = Table(title=f"rollfleet train ({summary['mode']}): summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("steps / weight syncs", f"{summary['steps']} / {summary['syncs']}")
    resumed = summary["session_steps"] != summary["steps"]
    of = f" over the {summary['session_steps']} steps of this session" if resumed else ""
    table.add_row("wall time", f"{summary['wall_s']:.1f} s ({summary['step_s_mean']:.2f} s/step{of})")
    table.add_row("trainer idle (waiting for samples)", f"{summary['idle_frac']:.0%}")
    table.add_row("mean reward, first 20% of steps", f"{summary['reward_first']:.3f}")
    table.add_row("mean reward, last 20% of steps", f"{summary['reward_last']:.3f}")
    table.add_row("outputs", summary["run_dir"])
    for p in summary.get("plots", []):
        table.add_row("plot", p)
    console.print(table)
    console.print(json.dumps({k: v for k, v in summary.items() if k != "plots"}))
