"""Pool the paired rounds of several ``gateway_vs_router.py`` runs: is the gateway's p50 above the router's?

One run's rounds vary 2-3x on 2 shared cores, and its median paired ratio moves by +-30% from run
to run, so one run cannot tell a 5% difference. This reads the JSON files of several runs, takes
every round's gateway/router ratio (tokens/s, p50), and reports per run and pooled: the median, how
many rounds the gateway was at least as good, and a bootstrap 95% interval of the pooled median.
The bootstrap resamples runs, then rounds within each run drawn: rounds of one run share its
host's state, so resampling rounds alone (as if all were independent) gave an interval too narrow
(tokens/s 1.005-1.226, against 0.97-1.31 by run). Seeded: the same files give the same numbers.

Run: ``python benchmarks/gateway_vs_router_pool.py benchmarks/gateway_vs_router.json
benchmarks/gateway_vs_router_runs/*.json`` (the runs at ``--max-num-seqs 128``; the two
``gateway_vs_router_seqs16*.json`` runs pool apart).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

PAIR = "rollfleet gateway / vllm-router"


def bootstrap_median(runs: list[list[float]], draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile interval of the pooled median of ``runs`` (each a run's rounds): runs
    resampled with replacement, then each drawn run's rounds."""
    rng = random.Random(seed)
    medians = []
    for _ in range(draws):
        pooled = [x for run in rng.choices(runs, k=len(runs)) for x in rng.choices(run, k=len(run))]
        medians.append(statistics.median(pooled))
    medians.sort()
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="JSON files that gateway_vs_router.py wrote")
    args = parser.parse_args()
    table = Table(title=f"{PAIR}: paired rounds")
    for col in (
        "run",
        "setup",
        "rounds",
        "tokens/s ratio (median)",
        "gateway >= router",
        "p50 ratio (median)",
        "gateway <=",
    ):
        table.add_column(col)
    tokens: list[list[float]] = []
    p50: list[list[float]] = []
    for path in args.files:
        run = json.loads(path.read_text())
        pair = run.get(PAIR)
        if not pair or "p50_ratios" not in pair:
            continue  # an early format without the rounds' ratios
        t, p = pair["tokens_per_s_ratios"], pair["p50_ratios"]
        tokens.append(t)
        p50.append(p)
        setup = ", ".join(f"{k} {v}" for k, v in run.get("setup", {}).items()) or "-"
        table.add_row(
            path.name, setup, str(len(t)), f"{statistics.median(t):.3f}x", str(sum(x >= 1 for x in t)),
            f"{statistics.median(p):.3f}x", str(sum(x <= 1 for x in p)),
        )  # fmt: skip
    if not p50:
        raise SystemExit("no run with per-round ratios among the files")
    t_low, t_high = bootstrap_median(tokens)
    p_low, p_high = bootstrap_median(p50)
    every_t, every_p = [x for run in tokens for x in run], [x for run in p50 for x in run]
    table.add_row(
        "pooled", "", str(len(every_p)), f"{statistics.median(every_t):.3f}x ({t_low:.3f}-{t_high:.3f})",
        str(sum(x >= 1 for x in every_t)), f"{statistics.median(every_p):.3f}x ({p_low:.3f}-{p_high:.3f})",
        str(sum(x <= 1 for x in every_p)),
    )  # fmt: skip
    Console(width=160).print(table)
    print("pooled: the median over every round, with its bootstrap 95% interval (runs, then their rounds, resampled)")


if __name__ == "__main__":
    main()
