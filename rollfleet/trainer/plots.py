"""PNG plots of a run: reward, throughput, staleness, and a timeline of rollout vs training vs
weight sync. Written at the end of ``rollfleet train`` (and by ``rollfleet plot RUN_DIR``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollfleet.trainer.tracking import read_jsonl

COLORS = {"wait": "#d9d9d9", "train": "#4c72b0", "sync": "#dd8452", "generating": "#55a868", "paused": "#c44e52"}


def legend_kinds(spans: list[dict[str, Any]]) -> list[str]:
    """The timeline legend's entries: one per kind of span that shows (a kind whose spans all
    have no width, such as a ``separate_async`` trainer's instant syncs, does not), in one order
    for every run (:data:`COLORS`'), kinds it does not know last."""
    shown = {s["kind"] for s in spans if s["end"] > s["start"]}
    return [k for k in COLORS if k in shown] + sorted(shown - COLORS.keys())


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    spans = read_jsonl(run_dir / "timeline.jsonl")
    written: list[Path] = []
    if rows:
        steps = [r["step"] for r in rows]
        panels = [
            ("reward.png", "mean reward", [("reward/mean", "mean"), ("reward/max", "max")]),
            ("throughput.png", "trained tokens / s", [("perf/tokens_per_s", "trained tokens/s")]),
            (
                "staleness.png",
                "staleness (weight versions)",
                [("staleness/mean", "mean"), ("staleness/max", "max"), ("staleness/dropped", "dropped groups")],
            ),
        ]
        for name, ylabel, series in panels:
            fig, ax = plt.subplots(figsize=(7, 3.8))
            for key, label in series:
                if any(key in r for r in rows):
                    ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker="o", ms=3, label=label)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend()
            ax.set_title(f"{run_dir.name}: {ylabel}")
            fig.tight_layout()
            path = run_dir / name
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    if spans:
        lanes = sorted({s["lane"] for s in spans}, reverse=True)
        fig, ax = plt.subplots(figsize=(10, 1.6 + 0.7 * len(lanes)))
        # back-to-back spans (one train step after another) stay apart, while spans are wide
        # enough that the white line between them does not wash the lane out
        edge = 0.4 if len(spans) <= 400 else 0.0
        for s in spans:
            ax.barh(
                lanes.index(s["lane"]),
                s["end"] - s["start"],
                left=s["start"],
                color=COLORS.get(s["kind"], "#8172b3"),
                edgecolor="white",
                linewidth=edge,
                height=0.6,
            )
        handles = [Patch(color=COLORS.get(k, "#8172b3"), label=k) for k in legend_kinds(spans)]
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels(lanes)
        ax.set_xlabel("seconds since start")
        if handles:  # below the lanes, where it covers none of them
            ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(handles), fontsize=8)
        ax.set_title(f"{run_dir.name}: timeline")
        fig.tight_layout()
        path = run_dir / "timeline.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


__all__ = ["legend_kinds", "plot_run"]
