"""``rollfleet plan``: every trainer mode on a simulated cluster, in virtual time, side by side.

The config gives the workload (``rollout.n``, ``prompt_length``, ``response_length``, the sim
engine's response-length distribution and step costs), the trainer's batch, staleness and sync
settings and the learner's cost; the command line gives the cluster. Outputs: a table (step time,
speed-up over ``sync``, trainer / fleet / cluster idle, staleness, dropped groups), ``plan.json``,
``plan.png`` and one timeline PNG per mode, under ``--out``. ``--rollout-share 0.25,0.5,0.75``
plans ``separate_async`` at each of those splits, side by side, and names the fastest; ``--tp 1,2,4``
with ``--model-params-b`` plans every mode at each replica size (the roofline prices each), and
``--vary KEY=V1,V2`` at each value of one config key; both compare every mode of every plan
(``plan_variants.json`` and ``.png``; each plan's own outputs in a folder under ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rollfleet.cli.plan_variants import Variant, tps_from_args
from rollfleet.config import RollfleetConfig
from rollfleet.plan.learner_cost import learner_seconds_per_token, learner_seconds_per_token_squared
from rollfleet.plan.planner import MODES, ModeRun, PlanResult, PlanSpec, run_plans
from rollfleet.plan.report import write_plan
from rollfleet.plan.result import fastest_split
from rollfleet.plan.roofline import ACCELERATORS, accelerator, engine_costs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML config (defaults if omitted)")
    p.add_argument("--gpus", type=int, required=True, help="accelerators in the cluster")
    p.add_argument(
        "--profile",
        default=None,
        help="engine costs: a shipped profile name (h100-7b, ...) or a YAML file from calibrate",
    )
    p.add_argument(
        "--tp",
        default="1",
        help="accelerators per replica (tensor parallelism); several, comma-separated, plan each (with --model-params-b)",
    )
    p.add_argument(
        "--rollout-share",
        default="0.5",
        help="separate_async: share of the accelerators that generate; several, comma-separated, plan each split",
    )
    p.add_argument(
        "--vary",
        default=None,
        metavar="KEY=V1,V2",
        help="plan each value of one config key side by side (e.g. trainer.max_off_policy_steps=0.5,1,2)",
    )
    p.add_argument("--modes", default=",".join(MODES), help="trainer modes, comma-separated")
    p.add_argument("--seeds", default="0,1,2", help="one run per seed per mode, comma-separated")
    p.add_argument("--steps", type=int, default=None, help="overrides trainer.total_steps")
    p.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the step time")
    p.add_argument(
        "--model-params-b",
        type=float,
        default=None,
        help="model size (billions): the learner's cost, and the engines' (a roofline on --accelerator at --tp) "
        "unless --profile gives them",
    )
    p.add_argument(
        "--model-layers",
        type=int,
        default=None,
        help="with --model-hidden: attention's cost in training, and TP's all-reduces (else estimated from the size)",
    )
    p.add_argument("--model-hidden", type=int, default=None, help="hidden size (e.g. 3584 for Qwen2.5-7B)")
    p.add_argument(
        "--accelerator", default=None, help=f"with --model-params-b: one of {', '.join(ACCELERATORS)} (default h100)"
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        help="with --model-params-b: 2 x layers x KV heads x head dim x 2 bytes (default 131072: Llama-3-8B; "
        "Qwen2.5-7B 57344)",
    )
    p.add_argument(
        "--tflops-per-gpu",
        type=float,
        default=None,
        help="with --model-params-b: peak dense TFLOPS per accelerator (default: --accelerator's)",
    )
    p.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="with --model-params-b: the learner's model FLOPs utilisation, in (0, 1]",
    )
    p.add_argument(
        "--flops-per-param-token",
        type=float,
        default=None,
        help="with --model-params-b: 6 (the default): forward + backward; +2 per extra forward pass",
    )
    p.add_argument(
        "--response-lengths",
        default=None,
        help="file of response lengths (integers, whitespace- or comma-separated, or a JSON list) to draw from "
        "instead of the config's log-normal",
    )
    p.add_argument("--out", default="runs/plan", help="where plan.json, plan.png and the runs go")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes running the mode x seed runs side by side (default: one per CPU core; 1: in this process)",
    )


def read_lengths(path: str) -> list[int]:
    """Response lengths from a file: a JSON list, or integers separated by commas or whitespace."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--response-lengths {path}: cannot be read ({exc})") from None
    as_json = text.lstrip().startswith("[")
    try:
        values = json.loads(text) if as_json else text.replace(",", " ").split()
    except ValueError as exc:
        raise ValueError(f"--response-lengths {path}: not a list of integers ({exc})") from None
    if not isinstance(values, list) or not values:
        raise ValueError(f"--response-lengths {path}: needs a list of at least one length")
    lengths = []
    for i, value in enumerate(values):
        # int() would truncate a float (1.9) and take a bool or a JSON string ("300") for a length
        if not as_json and re.fullmatch(r"[+-]?[0-9]+", value):
            value = int(value)
        if type(value) is not int or value < 1:
            raise ValueError(f"--response-lengths {path}: length [{i}] is {value!r}, not an integer >= 1")
        lengths.append(value)
    return lengths


#: The flags that describe the model --model-params-b names (read only with it), and their defaults.
_MODEL_FLAGS: dict[str, Any] = {
    "model_layers": None,
    "model_hidden": None,
    "accelerator": "h100",
    "kv_bytes_per_token": 131_072,
    "tflops_per_gpu": None,
    "mfu": 0.35,
    "flops_per_param_token": 6.0,
}


def overrides_from_args(args: argparse.Namespace, tp: Optional[int] = None) -> dict[str, Any]:
    """Config overrides (dotted keys) the command line sets for a plan at ``tp`` (default: the one
    ``--tp`` gives): applied to the YAML before it is validated, so what the config leaves unset
    stays unset (the plan fills in its own defaults)."""
    tp = tps_from_args(args)[0] if tp is None else tp
    out: dict[str, Any] = {"rollout.name": "sim"}
    if args.steps is not None:
        out["trainer.total_steps"] = args.steps
    profile: Optional[dict[str, Any]] = None
    if args.profile is not None:
        from rollfleet.plan.profiles import load_profile

        profile = load_profile(args.profile)
        out.update({f"rollout.sim.{k}": v for k, v in profile.items()})
    model = {k: getattr(args, k) for k in _MODEL_FLAGS}
    given = [f"--{k.replace('_', '-')}" for k, v in model.items() if v is not None]
    if args.model_params_b is None and given:  # nothing would read them: the config's costs price the plan
        raise ValueError(
            f"{', '.join(given)}: read only with --model-params-b (the model they describe); give its size too"
        )
    model = {k: _MODEL_FLAGS[k] if v is None else v for k, v in model.items()}
    if not 0 < model["mfu"] <= 1:
        raise ValueError(f"--mfu must be in (0, 1] (a fraction, not a percentage), got {model['mfu']:g}")
    if (args.model_layers is None) != (args.model_hidden is None):
        raise ValueError("--model-layers and --model-hidden go together (attention's cost needs both)")
    if args.model_params_b is not None:
        try:
            out.update(_model_costs(args, model, tp, profile))
        except ValueError as exc:  # the pricing functions name their arguments: name the flags instead
            said = str(exc)
            name = re.match(r"\w+", said)
            flag = _FLAG_OF.get(name.group(0)) if name else None
            if name is None or flag is None:
                raise
            raise ValueError(f"{flag}{said[name.end() :]}") from None
    if args.response_lengths is not None:
        out["rollout.sim.response_lengths"] = read_lengths(args.response_lengths)
    return out


#: The pricing functions' argument names -> the flag that gives each.
_FLAG_OF = {
    "params_b": "--model-params-b",
    "layers": "--model-layers",
    "hidden": "--model-hidden",
    "tflops_per_gpu": "--tflops-per-gpu",
    "kv_bytes_per_token": "--kv-bytes-per-token",
    "flops_per_param_token": "--flops-per-param-token",
    "gpus": "--gpus",
    "tp": "--tp",
}


def _model_costs(
    args: argparse.Namespace, model: dict[str, Any], tp: int, profile: Optional[dict[str, Any]]
) -> dict[str, Any]:
    """The learner's and (unless ``profile``, the ``--profile`` read, prices them) the engines'
    costs of ``--model-params-b``."""
    out: dict[str, Any] = {}
    device = accelerator(model["accelerator"])
    tflops = args.tflops_per_gpu if args.tflops_per_gpu is not None else device.tflops
    flops = model["flops_per_param_token"]
    out["trainer.sim_learner.seconds_per_token"] = learner_seconds_per_token(
        args.model_params_b, args.gpus, tflops, model["mfu"], flops
    )
    if args.model_layers is not None and args.model_hidden is not None:
        out["trainer.sim_learner.seconds_per_token_squared"] = learner_seconds_per_token_squared(
            args.model_layers, args.model_hidden, args.gpus, tflops, model["mfu"], flops
        )
    # the roofline checks that the model fits a replica, whoever prices the engine
    costs = engine_costs(
        args.model_params_b,
        device,
        tp=tp,
        kv_bytes_per_token=model["kv_bytes_per_token"],
        layers=args.model_layers,
        hidden=args.model_hidden,
    )
    if profile is None:
        out.update({f"rollout.sim.{k}": v for k, v in costs.items()})
        out["rollout.sim.tensor_parallel_size"] = tp  # the replica these costs price
    elif "kv_capacity_tokens" not in profile:  # a calibrated profile times steps, not memory
        out["rollout.sim.kv_capacity_tokens"] = costs["kv_capacity_tokens"]
    return out


def _share(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--rollout-share: {text.strip()!r} is not a number (a share in (0, 1): 0.5)") from None


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--seeds: {text.strip()!r} is not an integer (seeds are comma-separated: 0,1,2)") from None


def spec_from_args(args: argparse.Namespace, config: RollfleetConfig, variant: Optional[Variant] = None) -> PlanSpec:
    """The plan the flags ask for: ``variant``'s of several (its replica size, its runs under
    ``--out``/its folder), or the one plan."""
    tp = tps_from_args(args)[0] if variant is None else variant.tp
    shares = tuple(_share(s) for s in str(args.rollout_share).split(",") if s.strip())
    if not shares:
        raise ValueError("--rollout-share: give at least one share in (0, 1)")
    return PlanSpec(
        config,
        gpus=args.gpus,
        tp=tp,
        rollout_share=shares[0],
        more_shares=shares[1:],
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        seeds=tuple(_seed(s) for s in args.seeds.split(",") if s.strip()),
        warmup_steps=args.warmup_steps,
        output_dir=str(out_dir(args, variant) / "runs"),
    )


def out_dir(args: argparse.Namespace, variant: Optional[Variant] = None) -> Path:
    """Where a plan writes: ``--out``, or its variant's folder under it."""
    return Path(args.out) / variant.folder if variant is not None and variant.folder else Path(args.out)


def run(specs: list[PlanSpec], console: Console, workers: Optional[int] = None) -> list[PlanResult]:
    """Every spec's runs on one pool of processes (no worker idles between one size and the next)."""
    total = sum(len(spec.shares_of(mode)) * len(spec.seeds) for spec in specs for mode in spec.modes)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("planning", total=total)

        def done(r: ModeRun) -> None:
            progress.update(task, advance=1, description=f"{r.mode} seed {r.seed}: {r.step_s:.2f} s/step")

        return run_plans(specs, on_run=done, workers=workers or os.cpu_count() or 1)


def render(result: PlanResult, console: Console) -> None:
    spec = result.spec
    table = Table(
        title=f"plan: {spec.gpus} accelerators, tp {spec.tp}, seeds {','.join(map(str, spec.seeds))} "
        "(simulated seconds; means over seeds)"
    )
    for col in (
        "mode",
        "replicas",
        "s / step (range)",
        "speed-up vs sync",
        "trainer idle",
        "fleet idle",
        "cluster idle",
        "staleness mean / max",
        "dropped groups",
        "trained tok/s",
    ):
        table.add_column(col, justify="left" if col == "mode" else "right", no_wrap=col == "mode")
    rows = result.summary()
    for r in rows:
        lo, hi = r["step_s_range"]
        speedup: Any = r["speedup_vs_sync"]
        table.add_row(
            r["label"],
            str(r["replicas"]),
            f"{r['step_s']:.2f} ({lo:.2f}-{hi:.2f})",
            "-" if speedup is None else f"{speedup:.2f}x",
            f"{r['trainer_idle']:.0%}",
            f"{r['fleet_idle']:.0%}",
            f"{r['cluster_idle']:.0%}",
            f"{r['staleness_mean']:.2f} / {r['staleness_max']}",
            f"{r['dropped_groups']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
        )
    console.print(table)
    # Apart, to keep the main table narrow: what each mode ran on, and what its fleet served
    # beyond what was trained.
    served = Table(title="accelerators, and what the fleet served per trained token and sample (whole run)")
    for col in (
        "mode",
        "accelerators generating / training",
        "tokens generated / trained",
        "requests / trained sample",
    ):
        served.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows:
        shared = "" if r["mode"] == "separate_async" else " (the same ones)"
        served.add_row(
            r["label"],
            f"{r['rollout_gpus']} / {r['learner_gpus']}{shared}",
            f"{r['generated_per_trained']:.2f}",
            f"{r['requests_per_sample']:.2f}",
        )
    console.print(served)
    best = fastest_split(rows)
    if best is not None:
        speedup = best["speedup_vs_sync"]
        console.print(
            f"fastest split of separate_async: [bold]{best['rollout_gpus']}:{best['learner_gpus']}[/] "
            f"(generating : training), {best['tokens_per_s']:,.0f} trained tokens/s, {best['step_s']:.2f} s a step"
            + ("" if speedup is None else f", {speedup:.2f}x sync")
        )


def write_outputs(result: PlanResult, out: str | Path) -> list[Path]:
    from rollfleet.trainer.plots import plot_run

    written = write_plan(result, out)
    first: dict[str, ModeRun] = {}
    for r in result.runs:
        first.setdefault(result.label(r), r)
    for r in first.values():  # one timeline per mode and split (its first seed)
        written += [p for p in plot_run(r.run_dir) if p.name == "timeline.png"]
    return written


__all__ = ["add_arguments", "overrides_from_args", "spec_from_args", "run", "render", "write_outputs"]
