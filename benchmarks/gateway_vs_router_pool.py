"""Pool the paired rounds of several ``gateway_vs_router.py`` runs: is the gateway's p50 above the router's?

One run's rounds vary 2-3x on 2 shared cores, and its median paired ratio moves by +-30% from run
to run, so one run cannot tell a 5% difference. This reads the JSON files of several runs, takes
every round's gateway/router ratio (tokens/s, p50), and reports per run and pooled: the median, how
many rounds the gateway was at least as good, and a bootstrap 95% interval of the pooled median
(resampling rounds, seeded: the same files give the same numbers).

Run: ``python benchmarks/gateway_vs_router_pool.py benchmarks/gateway_vs_router*.json``.
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


def bootstrap_median(values: list[float], draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile interval of the median of ``values`` (rounds resampled with replacement)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
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
    tokens: list[float] = []
    p50: list[float] = []
    for path in args.files:
        run = json.loads(path.read_text())
        pair = run.get(PAIR)
        if not pair or "p50_ratios" not in pair:
            continue  # an early format without the rounds' ratios
        t, p = pair["tokens_per_s_ratios"], pair["p50_ratios"]
        tokens += t
        p50 += p
        setup = ", ".join(f"{k} {v}" for k, v in run.get("setup", {}).items()) or "-"
        table.add_row(
            path.name, setup, str(len(t)), f"{statistics.median(t):.3f}x", str(sum(x >= 1 for x in t)),
            f"{statistics.median(p):.3f}x", str(sum(x <= 1 for x in p)),
        )  # fmt: skip
    if not p50:
        raise SystemExit("no run with per-round ratios among the files")
    t_low, t_high = bootstrap_median(tokens)
    p_low, p_high = bootstrap_median(p50)
    table.add_row(
        "pooled", "", str(len(p50)), f"{statistics.median(tokens):.3f}x ({t_low:.3f}-{t_high:.3f})",
        str(sum(x >= 1 for x in tokens)), f"{statistics.median(p50):.3f}x ({p_low:.3f}-{p_high:.3f})",
        str(sum(x <= 1 for x in p50)),
    )  # fmt: skip
    Console(width=160).print(table)
    print("pooled: the median over every round, with its bootstrap 95% interval")


if __name__ == "__main__":
    main()
