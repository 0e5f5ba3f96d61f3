"""``rollfleet calibrate``: measure the configured engine's step costs and write a profile.

Starts one replica's engine of ``rollout`` (any registered engine; no Ray), times the probe grid
(:mod:`rollfleet.plan.calibrate`), fits the sim engine's cost model, prints every probe measured
against predicted, and writes the constants as a profile (a ``rollout.sim`` section) that
``rollfleet plan --profile`` lays over a plan's config.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from typing import Optional

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rollfleet.cli.paths import writable_file
from rollfleet.config import RollfleetConfig
from rollfleet.engines import build_engine
from rollfleet.plan.calibrate import Measurement, Probe, Profile, default_grid, fit, measure
from rollfleet.plan.profiles import write_profile

QUICK_GRID = [Probe(b, p, t) for b, p, t in ((1, 32, 16), (1, 32, 64), (8, 32, 16), (8, 32, 64), (1, 384, 16))]
QUICK_GRID += [Probe(b, p, t) for b, p, t in ((8, 384, 16), (16, 128, 48), (4, 256, 32))]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML config: rollout.name and its engine section, rollout.model")
    p.add_argument("--engine", default=None, help="overrides rollout.name")
    p.add_argument("--grid", choices=("quick", "default"), default="default", help="probe grid (quick: 8 probes)")
    p.add_argument("--repeats", type=int, default=2, help="runs per probe; the fastest counts")
    p.add_argument("--out", required=True, help="profile YAML to write")


async def calibrate(
    config: RollfleetConfig, grid: list[Probe], repeats: int, console: Optional[Console] = None
) -> Profile:
    """Start the engine, measure ``grid``, stop the engine, fit."""
    rollout = config.rollout
    if repeats < 1:  # before an engine starts (a vLLM start is most of a minute)
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if rollout.name == "sim" and rollout.sim.time_scale != 1:
        # calibration times the engine on the wall clock: a sim engine paced faster than real
        # time would be measured that much cheaper, and a plan on its profile priced so
        raise ValueError(
            f"rollout.sim.time_scale must be 1 to calibrate the sim engine (its steps would be timed "
            f"{rollout.sim.time_scale:g}x off), got {rollout.sim.time_scale:g}"
        )
    longest = max(p.prompt_tokens + p.output_tokens for p in grid)
    if rollout.max_model_len is not None and longest > rollout.max_model_len:
        raise ValueError(f"rollout.max_model_len ({rollout.max_model_len}) must be >= {longest} for this grid")
    # The fit prices a probe's batch as one running batch: one run in waves, or preempted for KV,
    # is timed as something else, and fitted all the same (5x the per-sequence cost at 8 slots)
    widest = max(p.batch for p in grid)
    seqs = getattr(getattr(rollout, rollout.name, None), "max_num_seqs", None)
    if seqs is not None and widest > seqs:
        raise ValueError(f"rollout.{rollout.name}.max_num_seqs ({seqs}) must be >= {widest}: the grid's widest batch")
    kv_needed = max(p.batch * (p.prompt_tokens + p.output_tokens) for p in grid)
    if rollout.name == "sim" and rollout.sim.kv_capacity_tokens < kv_needed:
        raise ValueError(
            f"rollout.sim.kv_capacity_tokens ({rollout.sim.kv_capacity_tokens}) must be >= {kv_needed}: "
            "the grid's largest batch, whole, without preemption"
        )
    engine = build_engine(rollout, replica_index=0)
    await engine.start()
    try:
        with Progress(console=console, transient=True, disable=console is None) as progress:
            task = progress.add_task("measuring", total=len(grid))

            def done(m: Measurement) -> None:
                p = m.probe
                progress.update(task, advance=1, description=f"B={p.batch} P={p.prompt_tokens} T={p.output_tokens}")

            measurements = await measure(engine, grid, repeats=repeats, on_probe=done)
    finally:
        await engine.shutdown()
    return fit(measurements)


def render(profile: Profile, console: Console) -> None:
    table = Table(title="calibration: each probe measured (fastest run) and predicted by the fitted model")
    for col in ("batch", "prompt", "output", "measured s", "predicted s", "error"):
        table.add_column(col, justify="right")
    for m, err in zip(profile.measurements, profile.errors()):
        p = m.probe
        table.add_row(
            str(p.batch),
            str(p.prompt_tokens),
            str(p.output_tokens),
            f"{m.seconds:.3f}",
            f"{profile.predict_s(p):.3f}",
            f"{err:+.0%}",
        )
    console.print(table)
    for key, value in profile.constants.items():
        console.print(f"  {key}: {value:.6g}")


def header(config: RollfleetConfig, profile: Profile) -> str:
    errors = [abs(e) for e in profile.errors()]
    return (
        f"Measured by `rollfleet calibrate` on {datetime.date.today().isoformat()}: engine "
        f"'{config.rollout.name}', model '{config.rollout.model}', {len(profile.measurements)} probes.\n"
        f"Fit: median |error| {statistics.median(errors):.0%}, max {max(errors):.0%}; per-request "
        f"overhead outside the engine's steps {profile.constants['overhead_ms']:.1f} ms (not set here: rollout.sim.request_overhead_ms)."
    )


def run(args: argparse.Namespace, config: RollfleetConfig, console: Console) -> int:
    import asyncio

    grid = QUICK_GRID if args.grid == "quick" else default_grid()
    writable_file(args.out, "--out")  # before minutes of measuring, not after
    profile = asyncio.run(calibrate(config, grid, args.repeats, console))
    render(profile, console)
    # the replica these costs price: a plan at another tp refuses the profile
    sim = {**profile.sim_section(), "tensor_parallel_size": config.rollout.tensor_parallel_size}
    path = write_profile(args.out, sim, header(config, profile))
    console.print(f"  wrote {path}")
    return 0


__all__ = ["add_arguments", "calibrate", "render", "run", "QUICK_GRID"]
