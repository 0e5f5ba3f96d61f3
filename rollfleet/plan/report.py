"""A plan's files: ``plan.json`` (the summary and every run) and ``plan.png`` (step time and idle
fractions per mode, and per split of ``separate_async`` where a plan has several); for plans of
one cluster that differ in one thing, ``plan_variants.json`` and ``plan_variants.png`` beside them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from rollfleet.plan.result import PlanResult


def write_plan(result: PlanResult, out: str | Path) -> list[Path]:
    """``plan.json`` (the summary and every run) and ``plan.png`` (step time and idle fractions
    per mode) under ``out``; each run's own timeline PNG is in its run folder."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec, rows = result.spec, result.summary()
    doc = {
        "gpus": spec.gpus,
        "tp": spec.tp,
        "rollout_share": spec.rollout_share,
        "rollout_shares": list(spec.shares),
        "seeds": list(spec.seeds),
        "summary": rows,
        "runs": [vars(r) for r in result.runs],
    }
    json_path = out / "plan.json"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    return [json_path, _plot_summary(result, rows, out / "plan.png")]


def _plot_summary(result: PlanResult, rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["label"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10.0, 2.2 * len(rows)), 3.8))
    ax1.bar(names, [r["step_s"] for r in rows], yerr=_spread(rows, "step_s"), color="#64b5cd", capsize=4)
    ax1.set_ylabel("simulated seconds per step")
    ax1.set_title(f"step time ({result.spec.gpus} accelerators, tp {result.spec.tp})")
    x = range(len(rows))
    bars = [
        ("trainer_idle", "trainer idle", "#d9d9d9"),
        ("fleet_idle", "fleet idle", "#c44e52"),
        ("cluster_idle", "cluster idle", "#8172b3"),
    ]
    for k, (key, label, color) in enumerate(bars):
        ax2.bar([i + (k - 1) * 0.27 for i in x], [r[key] for r in rows], width=0.27, label=label, color=color)
    ax2.set_xticks(list(x), names)
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("share of the time")
    ax2.set_title("idle (trainer: after warm-up; fleet, cluster: whole run)", fontsize=10)
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=20 if _crowded(names) else 0)
        ax.set_axisbelow(True)  # the grid behind the bars
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _crowded(labels: list[str]) -> bool:
    """Whether tick labels side by side would run into each other (then they are slanted)."""
    return len(labels) > 3 or max(map(len, labels), default=0) > 14


def _spread(rows: list[dict[str, Any]], key: str) -> Optional[list[list[float]]]:
    """Error bars from each row's range over seeds (``key``'s ``_range``); None where every range
    is a point (one seed), which would draw a stray cap on each bar."""
    low = [max(0.0, r[key] - r[f"{key}_range"][0]) for r in rows]
    high = [max(0.0, r[f"{key}_range"][1] - r[key]) for r in rows]
    return [low, high] if any(low) or any(high) else None


def compare(results: list[PlanResult], names: list[str]) -> list[dict[str, Any]]:
    """Every plan's summary rows with the plan's name (``plan``) and replica size, fastest first:
    plans of one cluster that differ in one thing (a replica size, a config value). Fastest is
    trained tokens per second, not the step: a varied key may change a step's work
    (``rollout.n=8,16``), and the shorter step then trains less."""
    rows = [{"plan": name, "tp": res.spec.tp, **row} for name, res in zip(names, results) for row in res.summary()]
    return sorted(rows, key=lambda r: (-r["tokens_per_s"], r["step_s"]))


def write_variants(results: list[PlanResult], names: list[str], out: str | Path) -> list[Path]:
    """``plan_variants.json`` (:func:`compare`'s rows, the fastest first) and ``plan_variants.png``
    (trained tokens per second per mode, a bar per plan, the fastest marked) under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = compare(results, names)
    doc = {"gpus": results[0].spec.gpus, "plans": names, "fastest": rows[0], "rows": rows}
    json_path = out / "plan_variants.json"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    return [json_path, _plot_variants(results, names, rows[0], out / "plan_variants.png")]


def _plot_variants(results: list[PlanResult], names: list[str], best: dict[str, Any], path: Path) -> Path:
    """What the ranking ranks by: trained tokens per second (a varied key may change a step's
    work, so a shorter step is not a faster plan), with each plan's range over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = [res.summary() for res in results]
    labels = list(dict.fromkeys(row["label"] for rows in summaries for row in rows))
    width = 0.8 / len(results)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.8 * len(labels)), 4.2))
    for k, (name, rows) in enumerate(zip(names, summaries)):
        by_label = {row["label"]: row for row in rows}
        mine = [by_label[label] for label in labels if label in by_label]
        xs = [labels.index(row["label"]) + (k - (len(results) - 1) / 2) * width for row in mine]
        bars = ax.bar(xs, [row["tokens_per_s"] for row in mine], width=width, label=name)
        ax.errorbar(xs, [row["tokens_per_s"] for row in mine], yerr=_spread(mine, "tokens_per_s"), fmt="none",
                    ecolor="black", capsize=3)  # fmt: skip
        for bar, row in zip(bars, mine):
            if name == best["plan"] and row["label"] == best["label"]:
                bar.set_edgecolor("black")
                bar.set_linewidth(2)
                top = row["tokens_per_s_range"][1]  # above its error bar
                ax.annotate("fastest", (bar.get_x() + bar.get_width() / 2, top), ha="center",
                            va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")  # fmt: skip
    ax.set_xticks(range(len(labels)), labels, rotation=20 if _crowded(labels) else 0)
    ax.set_ylabel("trained tokens per simulated second")
    ax.set_title(f"trained tokens per second per plan ({results[0].spec.gpus} accelerators; higher is faster)")
    ax.set_axisbelow(True)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=min(4, len(names)))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


__all__ = ["write_plan", "write_variants", "compare"]
