"""The plans one ``rollfleet plan`` compares: one per replica size (``--tp 1,2,4``) or per value of
one config key (``--vary trainer.max_off_policy_steps=0.5,1,2``), and the table of every mode of
every plan, fastest first. One thing varies at a time, so every difference has one cause."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from rollfleet.config import RollfleetConfig
from rollfleet.plan.report import compare
from rollfleet.plan.result import PlanResult
from rollfleet.plan.spec import PLAN_OWNED

#: What a folder name made from a ``--vary`` value may not hold.
_FOLDER_UNSAFE = re.compile(r"[^\w.=+,-]")


@dataclass(frozen=True)
class Variant:
    """One plan of a comparison: its name in the tables, its replica size, the config overrides it
    adds and the folder under ``--out`` its outputs go to ("" for a plan of one)."""

    name: str
    tp: int
    overrides: dict[str, Any] = field(default_factory=dict)
    folder: str = ""


def tps_from_args(args: argparse.Namespace) -> list[int]:
    """The replica sizes to plan. Several need the roofline (``--model-params-b``, no
    ``--profile``): a profile, or the config's costs, price one size of replica."""
    tps = []
    for text in str(args.tp).split(","):
        if text.strip():
            try:
                tps.append(int(text))
            except ValueError:
                raise ValueError(
                    f"--tp: {text.strip()!r} is not an integer (sizes are comma-separated: 1,2,4)"
                ) from None
    if not tps or len(set(tps)) < len(tps):
        raise ValueError(f"--tp: give one or more different sizes, got {args.tp!r}")
    if len(tps) > 1 and (args.model_params_b is None or args.profile is not None):
        raise ValueError(
            f"--tp {args.tp}: several replica sizes need --model-params-b without --profile (the roofline prices "
            "each size; a profile or the config's costs price one)"
        )
    return tps


def variants_from_args(args: argparse.Namespace) -> list[Variant]:
    """The plans to make: one, one per ``--tp`` size, or one per ``--vary`` value (each value read
    as YAML: ``1`` an int, ``0.5`` a float, ``true`` a bool, ``mask`` a string)."""
    tps = tps_from_args(args)
    vary = getattr(args, "vary", None)
    if vary is None:
        if len(tps) == 1:
            return [Variant("", tps[0])]
        return [Variant(f"tp {tp}", tp, {}, f"tp{tp}") for tp in tps]
    if len(tps) > 1:
        raise ValueError("--vary with several --tp sizes: vary one thing at a time")
    key, sep, values = vary.partition("=")
    key = key.strip()
    texts = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key or not texts or any(not part for part in key.split(".")):
        raise ValueError(
            f"--vary: KEY=V1,V2,... with a dotted config key (trainer.max_off_policy_steps=0.5,1,2), got {vary!r}"
        )
    if len(set(texts)) < len(texts):
        raise ValueError(f"--vary {key}: values must not repeat, got {texts}")
    if key in PLAN_OWNED:  # overwritten in every run: plans that differ in nothing
        flag = PLAN_OWNED[key]
        raise ValueError(f"--vary {key}: every plan sets it itself" + (f" (from {flag})" if flag else ""))
    section = key.split(".")[0]
    if section not in RollfleetConfig.model_fields:  # kept unread by the config: plans that differ in nothing
        raise ValueError(
            f"--vary {key}: {section!r} is not a config section ({', '.join(RollfleetConfig.model_fields)})"
        )
    # A value becomes a folder under --out: one path component, whatever the value says
    # (a '/' in it would nest folders, '../..' would write outside --out).
    folders = [_FOLDER_UNSAFE.sub("_", f"{key}={text}") for text in texts]
    if len(set(folders)) < len(folders):
        raise ValueError(f"--vary {key}: values {texts} name the same folder once made safe: {folders}")
    return [
        Variant(f"{key}={text}", tps[0], {key: yaml.safe_load(text)}, folder) for text, folder in zip(texts, folders)
    ]


def render_variants(results: list[PlanResult], variants: list[Variant], console: Console) -> None:
    """Every mode (and split) of every plan, fastest (most trained tokens per second) first, and
    the fastest named."""
    table = Table(title=f"every plan: {results[0].spec.gpus} accelerators (simulated seconds; means over seeds)")
    columns = (
        "plan",
        "mode",
        "replicas",
        "s / step",
        "trained tok/s",
        "of the fastest's",
        "trainer idle",
        "fleet idle",
    )
    for col in columns:
        table.add_column(col, justify="left" if col in ("plan", "mode") else "right", no_wrap=col in ("plan", "mode"))
    rows = compare(results, [v.name for v in variants])
    best = rows[0]
    for r in rows:
        table.add_row(
            r["plan"],
            r["label"],
            str(r["replicas"]),
            f"{r['step_s']:.2f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / best['tokens_per_s']:.0%}" if best["tokens_per_s"] > 0 else "-",
            f"{r['trainer_idle']:.0%}",
            f"{r['fleet_idle']:.0%}",
        )
    console.print(table)
    console.print(
        f"fastest: [bold]{best['label']}, {best['plan']}[/], {best['tokens_per_s']:,.0f} trained tokens/s "
        f"({best['step_s']:.2f} s a step)"
    )


__all__ = ["Variant", "tps_from_args", "variants_from_args", "render_variants"]
