"""The ``rollfleet`` command line: ``rollfleet simulate`` (more subcommands arrive with their layers)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Optional

from rich.console import Console

from rollfleet.config import load_config


def _simulate(args: argparse.Namespace) -> int:
    from rollfleet.cli.simulate import SimulateOptions, render, run_simulation

    overrides = {}
    if args.replicas is not None:
        overrides["rollout.num_replicas"] = args.replicas
    if args.time_scale is not None:
        overrides["rollout.sim.time_scale"] = args.time_scale
    config = load_config(args.config, overrides)
    if config.rollout.name != "sim":
        print(f"rollfleet simulate runs the sim engine; the config names '{config.rollout.name}'", file=sys.stderr)
        return 2
    opts = SimulateOptions(sessions=args.sessions, turns=args.turns, weight_updates=args.weight_updates)
    console = Console()
    console.print(
        f"[bold]rollfleet simulate[/]: {opts.sessions} sessions x {opts.turns} turns on "
        f"{config.rollout.num_replicas} simulated replicas (time scale {config.rollout.sim.time_scale}x, "
        f"routing {config.rollout.routing.policy})"
    )
    result = asyncio.run(run_simulation(config, opts, console))
    render(result, console)
    ok = result.trajectories == opts.sessions
    return 0 if ok else 1


def main(argv: Optional[list[str]] = None) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="rollfleet", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="multi-turn rollout over a simulated fleet, with weight updates")
    sim.add_argument("--config", default=None, help="YAML config (defaults if omitted)")
    sim.add_argument("--sessions", type=int, default=300)
    sim.add_argument("--turns", type=int, default=3)
    sim.add_argument("--weight-updates", type=int, default=3)
    sim.add_argument("--replicas", type=int, default=None)
    sim.add_argument("--time-scale", type=float, default=None)
    sim.set_defaults(func=_simulate)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
