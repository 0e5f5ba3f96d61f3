"""Trainer modes side by side: wall time per step and trainer idle fraction, same workload.

The simulated engine and the simulated learner split the same simulated resources (think of
``--resources`` GPUs):

* ``sync`` and ``colocate_async`` take turns on all of them: ``--resources`` replicas generate,
  then the learner trains with the whole share (the fleet is paused meanwhile);
* ``separate_async`` splits them: half the replicas generate while the learner trains on the
  other half (so each learner step takes twice as long), continuously.

The workload is long-tailed (log-normal response lengths capped at ``--response-length``), the
regime where waiting for the slowest trajectory of every batch hurts ``sync`` most.

Run: ``python benchmarks/modes.py`` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from rich.console import Console
from rich.table import Table

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from rollfleet.config import load_config
from rollfleet.models.vocab import fit_sim_to_model
from rollfleet.trainer import get_trainer_cls


def config_for(mode: str, args: argparse.Namespace, run_dir: str):
    separate = mode == "separate_async"
    replicas = args.resources // 2 if separate else args.resources
    overrides = {
        "rollout.name": "sim",
        "rollout.num_replicas": replicas,
        "rollout.n": args.n,
        "rollout.prompt_length": 128,
        "rollout.response_length": args.response_length,
        "rollout.max_model_len": 128 + args.response_length + 8,
        "rollout.sim.time_scale": args.time_scale,
        "rollout.sim.mean_response_tokens": args.mean_response,
        "rollout.sim.response_sigma": args.sigma,
        "agent.num_workers": 2,
        "trainer.trainer_mode": mode,
        "trainer.total_steps": args.steps,
        "trainer.train_batch_size": args.batch,
        "trainer.parameter_sync_step": 1,
        "trainer.max_off_policy_steps": 2,
        "trainer.max_inflight_groups": 2 * args.batch,
        "trainer.max_queue_groups": 2 * args.batch,
        "trainer.output_dir": run_dir,
        "trainer.run_name": f"bench-{mode}",
        "trainer.sim_learner.enabled": True,
        "trainer.sim_learner.seconds_per_token": args.seconds_per_token,
        "trainer.sim_learner.resource_share": 0.5 if separate else 1.0,
        "ray.num_cpus": 2,
    }
    return fit_sim_to_model(load_config(None, overrides))


async def run_mode(mode: str, args: argparse.Namespace) -> dict:
    trainer = get_trainer_cls(mode)(config_for(mode, args, args.run_dir))
    try:
        await trainer.init()
        await trainer.fit()
    finally:
        await trainer.close()
    rows = trainer.tracker.history[args.warmup :]  # the first steps include start-up transients
    return {
        "mode": mode,
        "step_s": statistics.fmean(r["step_s"] for r in rows),
        "idle": sum(r["wait_s"] for r in rows) / sum(r["step_s"] for r in rows),
        "staleness": statistics.fmean(r["staleness/mean"] for r in rows),
        "tokens_per_s": statistics.fmean(r["perf/tokens_per_s"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resources", type=int, default=4, help="simulated accelerators (replicas in sync mode)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="GRPO groups per step")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument("--mean-response", type=float, default=150.0)
    parser.add_argument("--sigma", type=float, default=1.2)
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--seconds-per-token", type=float, default=1e-4)
    parser.add_argument("--run-dir", default="runs")
    args = parser.parse_args()
    console = Console(width=140)
    results = []
    for mode in ("sync", "colocate_async", "separate_async"):
        console.print(f"running {mode} ...")
        results.append(asyncio.run(run_mode(mode, args)))
    base = results[0]
    table = Table(
        title=f"trainer modes on {args.resources} simulated accelerators, long-tailed responses (sigma {args.sigma})"
    )
    for col in ("mode", "wall s / step", "speed-up vs sync", "trainer idle", "mean staleness", "gen tokens/s"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in results:
        table.add_row(
            r["mode"],
            f"{r['step_s']:.2f}",
            f"{base['step_s'] / r['step_s']:.2f}x",
            f"{r['idle']:.0%}",
            f"{r['staleness']:.2f}",
            f"{r['tokens_per_s']:,.0f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
