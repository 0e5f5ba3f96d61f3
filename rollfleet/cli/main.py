"""The ``rollfleet`` command line: ``simulate``, ``plan``, ``calibrate``, ``serve``, ``train``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any, Callable, Coroutine, Optional

from pydantic import ValidationError
from rich.console import Console

from rollfleet.config import RollfleetConfig, load_config
from rollfleet.errors import RollfleetError


class _ConfigRejected(Exception):
    """The config did not validate; already reported on stderr."""


def _load(path: Optional[str], overrides: dict, warn: bool = True) -> RollfleetConfig:
    """``load_config`` for a command: a bad config is reported (every bad field named) and the
    command exits with status 2 before it starts Ray or any engine."""
    try:
        config = load_config(path, overrides)
    except (ValidationError, RollfleetError) as exc:
        # a field the command line set is its fault, not the file's
        locs = [".".join(map(str, e["loc"])) for e in exc.errors()] if isinstance(exc, ValidationError) else []
        flagged = sorted({loc for loc in locs if loc in overrides})
        given = f" with the command line's {', '.join(flagged)}" if flagged else ""
        print(f"rollfleet: invalid config{f' {path}' if path else ''}{given}:\n{exc}", file=sys.stderr)
        raise _ConfigRejected() from exc
    except (OSError, ValueError) as exc:  # not there, unreadable, not YAML, not a mapping
        print(f"rollfleet: cannot read config: {exc}", file=sys.stderr)
        raise _ConfigRejected() from exc
    unread = list(config.model_extra or {}) if warn else []
    for name in unread:  # kept for tools built on top; a typo would cost a run
        print(
            f"rollfleet: config section {name!r} is not one rollfleet reads "
            f"({', '.join(RollfleetConfig.model_fields)}); ignored",
            file=sys.stderr,
        )
    return config


def _simulate(args: argparse.Namespace) -> int:
    from rollfleet.cli.preflight import check_engine
    from rollfleet.cli.simulate import SimulateOptions, context_needed, fit_context, render, run_simulation

    overrides = {}
    if args.replicas is not None:
        overrides["rollout.num_replicas"] = args.replicas
    if args.time_scale is not None:  # wall-clock pacing: a virtual fleet runs unscaled whatever it says
        if args.virtual:
            print("rollfleet simulate: --time-scale paces against the wall clock; --virtual has none", file=sys.stderr)
            return 2
        overrides["rollout.sim.time_scale"] = args.time_scale
    config = _load(args.config, overrides)  # unseeded, a virtual run's policy is seeded by run_simulation
    if config.rollout.name != "sim":
        print(f"rollfleet simulate runs the sim engine; the config names '{config.rollout.name}'", file=sys.stderr)
        return 2
    try:
        opts = SimulateOptions(sessions=args.sessions, turns=args.turns, weight_updates=args.weight_updates)
        if config.rollout.num_replicas < 1:  # a fleet may start empty and grow; a simulation cannot
            raise ValueError(f"rollout.num_replicas must be >= 1, got {config.rollout.num_replicas}")
        fitted = fit_context(config, opts)  # what the replicas will start with
        try:
            check_engine(fitted)
        except ValueError as exc:
            if fitted is config:
                raise
            raise ValueError(
                f"{exc}: the simulation raises rollout.max_model_len ({config.rollout.max_model_len}) to "
                f"{context_needed(opts):,}, the longest context its sessions reach ({opts.turns} turns)"
            ) from None
    except ValueError as exc:
        print(f"rollfleet simulate: {exc}", file=sys.stderr)
        return 2
    console = Console()
    pace = "virtual time" if args.virtual else f"time scale {config.rollout.sim.time_scale}x"
    console.print(
        f"[bold]rollfleet simulate[/]: {opts.sessions} sessions x {opts.turns} turns on "
        f"{config.rollout.num_replicas} simulated replicas ({pace}, routing {config.rollout.routing.policy})"
    )
    if args.virtual:
        from rollfleet.utils import virtual_time

        result = virtual_time.run(run_simulation(config, opts, console, virtual=True))
    else:
        result = asyncio.run(run_simulation(config, opts, console))
    render(result, console, virtual=args.virtual)
    ok = result.trajectories == opts.sessions
    return 0 if ok else 1


def _plan(args: argparse.Namespace) -> int:
    """Every trainer mode on a simulated cluster in virtual time (see rollfleet.cli.plan)."""
    from rollfleet.cli import plan as cli
    from rollfleet.cli.paths import writable_dir
    from rollfleet.cli.plan_variants import render_variants, variants_from_args
    from rollfleet.models.vocab import fit_sim_to_model
    from rollfleet.plan.report import write_variants

    if args.workers is not None and args.workers < 1:
        print(f"rollfleet plan: --workers must be >= 1, got {args.workers}", file=sys.stderr)
        return 2
    try:
        writable_dir(args.out, "--out")
        variants = variants_from_args(args)
        specs = []
        for v in variants:
            flags = cli.overrides_from_args(args, v.tp)
            # The same key, or one inside the other: a section given whole replaces what a flag set in it.
            both = sorted(
                f for f in flags for k in v.overrides if f == k or f.startswith(f"{k}.") or k.startswith(f"{f}.")
            )
            if both:  # --vary would win without a word
                raise ValueError(
                    f"--vary {next(iter(v.overrides))}: a flag given sets {both[0]} too (--steps, --profile, "
                    "--model-params-b or --response-lengths); set it one way"
                )
            specs.append(cli.spec_from_args(args, fit_sim_to_model(_load(args.config, {**flags, **v.overrides})), v))
    except ValueError as exc:  # a bad flag or plan; a bad config is reported by _load
        print(f"rollfleet plan: {exc}", file=sys.stderr)
        return 2
    console = Console(width=None if sys.stdout.isatty() else 160)  # the table is wide
    spec = specs[0]

    def each(values: list[int]) -> str:  # "8", or "4, 8" where varied plans differ in it
        return ", ".join(str(v) for v in dict.fromkeys(values))

    seeds = len(spec.seeds)
    console.print(
        f"[bold]rollfleet plan[/]: {', '.join(spec.modes)} on {spec.gpus} accelerators "
        f"(tp {each([s.tp for s in specs])}), {each([s.train.total_steps for s in specs])} steps x {seeds} "
        f"seed{'s' if seeds > 1 else ''}, in virtual time"
        + (f"; {len(specs)} plans: {', '.join(v.name for v in variants)}" if len(specs) > 1 else "")
    )
    results = cli.run(specs, console, args.workers)
    written = []
    for variant, result in zip(variants, results):
        if variant.name:
            console.print(f"[bold]{variant.name}[/]")
        cli.render(result, console)
        written += cli.write_outputs(result, cli.out_dir(args, variant))
    if len(results) > 1:
        render_variants(results, variants, console)
        written += write_variants(results, [v.name for v in variants], args.out)
    for path in written:
        console.print(f"  wrote {path}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """Measure an engine's step costs; write them as a profile (see rollfleet.cli.calibrate)."""
    from rollfleet.cli.calibrate import run

    config = _load(args.config, {"rollout.name": args.engine} if args.engine else {})
    console = Console()
    console.print(f"[bold]rollfleet calibrate[/]: '{config.rollout.name}' engine, model '{config.rollout.model}'")
    try:
        return run(args, config, console)
    except ValueError as exc:
        print(f"rollfleet calibrate: {exc}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    """Ray + fleet + OpenAI-compatible gateway until Ctrl-C / SIGTERM (see rollfleet.gateway)."""
    from rollfleet.cli.preflight import check_serve
    from rollfleet.gateway.launch import serve

    overrides: dict = {}
    for key, value in (
        ("gateway.host", args.host),
        ("gateway.port", args.port),
        ("rollout.num_replicas", args.replicas),
        ("gateway.prometheus_file", args.prometheus_file),
        ("gateway.admin_token", os.environ.get("ROLLFLEET_ADMIN_TOKEN") or None),  # set but empty: not given
    ):
        if value is not None:
            overrides[key] = value
    config = _load(args.config, overrides)
    try:
        check_serve(config)
    except ValueError as exc:
        print(f"rollfleet serve: {exc}", file=sys.stderr)
        return 2
    if not config.gateway.admin_token:
        print("admin routes off (set gateway.admin_token or ROLLFLEET_ADMIN_TOKEN to enable /admin)", file=sys.stderr)

    def announce(url: str) -> None:
        print(
            f"rollfleet gateway serving '{config.gateway.served_model_name or config.rollout.model}' "
            f"on {config.rollout.num_replicas} {config.rollout.name} replicas at {url}",
            flush=True,
        )
        print(f"  OpenAI base URL: {url}/v1    metrics: {url}/metrics    Ctrl-C to stop", flush=True)

    runner: Callable[[Coroutine[Any, Any, int]], int]  # uvloop.run and asyncio.run differ in options only
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is optional
        runner = asyncio.run
    try:
        return runner(serve(config, announce=announce))
    except RollfleetError as exc:  # the cluster or this host cannot give what the config asks (a port, devices)
        print(f"rollfleet serve: {exc}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace) -> int:
    """RL training on the fleet (see rollfleet.trainer); outputs under runs/<run_name>/."""
    from rollfleet.cli.paths import writable_dir
    from rollfleet.cli.preflight import check_train
    from rollfleet.cli.train import render_summary, run_training
    from rollfleet.trainer.config import TrainConfig

    overrides: dict = {}
    for key, value in (
        ("rollout.name", args.engine),
        ("trainer.trainer_mode", args.mode),
        ("trainer.total_steps", args.steps),
        ("trainer.run_name", args.run_name),
        ("trainer.resume", True if args.resume else None),
    ):
        if value is not None:
            overrides[key] = value
    config = _load(args.config, overrides)  # the trainer section too: a typo fails before Ray starts
    try:
        train = TrainConfig.model_validate(config.trainer.model_dump())  # validated by _load already
        check_train(config, train.task)
        writable_dir(os.path.join(train.output_dir, train.run_name), "trainer.output_dir / trainer.run_name")
        if config.rollout.name == "sim":
            from rollfleet.models.vocab import fit_sim_to_model

            config = fit_sim_to_model(config)  # a vocabulary the config sets otherwise is refused
    except ValueError as exc:
        print(f"rollfleet train: {exc}", file=sys.stderr)
        return 2
    console = Console()
    console.print(
        f"[bold]rollfleet train[/]: {config.trainer.trainer_mode} on {config.rollout.num_replicas} "
        f"{config.rollout.name} replicas, model '{config.rollout.model}'"
    )
    summary = asyncio.run(run_training(config, console))
    render_summary(summary, console)
    return 0


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
    sim.add_argument(
        "--virtual", action="store_true", help="in-process fleet in virtual time: simulated seconds, same on any host"
    )
    sim.set_defaults(func=_simulate)

    pln = sub.add_parser("plan", help="trainer modes side by side on a simulated cluster, in virtual time")
    from rollfleet.cli.plan import add_arguments

    add_arguments(pln)
    pln.set_defaults(func=_plan)

    cal = sub.add_parser("calibrate", help="measure an engine's step costs and write them as a plan profile")
    from rollfleet.cli import calibrate as calibrate_cli

    calibrate_cli.add_arguments(cal)
    cal.set_defaults(func=_calibrate)

    srv = sub.add_parser("serve", help="start Ray, the fleet and the OpenAI-compatible gateway; Ctrl-C stops all")
    srv.add_argument("--config", default=None, help="YAML config (defaults if omitted)")
    srv.add_argument("--host", default=None, help="overrides gateway.host")
    srv.add_argument("--port", type=int, default=None, help="overrides gateway.port (0 picks a free port)")
    srv.add_argument("--replicas", type=int, default=None, help="overrides rollout.num_replicas")
    srv.add_argument("--prometheus-file", default=None, help="overrides gateway.prometheus_file")
    srv.set_defaults(func=_serve)

    trn = sub.add_parser("train", help="RL training (GRPO) on the fleet: sync | colocate_async | separate_async")
    trn.add_argument("--config", default=None, help="YAML config (defaults if omitted)")
    trn.add_argument(
        "--engine", default=None, help="overrides rollout.name (a registered engine: sim | vllm | sglang...)"
    )
    trn.add_argument("--mode", default=None, help="overrides trainer.trainer_mode")
    trn.add_argument("--steps", type=int, default=None, help="overrides trainer.total_steps")
    trn.add_argument("--run-name", default=None, help="overrides trainer.run_name")
    trn.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    trn.set_defaults(func=_train)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except _ConfigRejected:
        return 2


if __name__ == "__main__":
    sys.exit(main())
