"""Named engine-cost profiles: ``rollout.sim`` sections as YAML files, shipped with the package
(published numbers) or written by ``rollfleet calibrate`` (measured). ``rollfleet plan --profile
NAME`` (or a path) lays one over the config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rollfleet.config import SimEngineConfig

HERE = Path(__file__).parent


def names() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def load_profile(name_or_path: str) -> dict[str, Any]:
    """The profile's ``rollout.sim`` keys, from a shipped name or a YAML file."""
    path = Path(name_or_path)
    if not path.is_file():
        path = HERE / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ValueError(f"unknown profile {name_or_path!r}: not a file, and not one of {names()}")
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"profile {path}: not a readable YAML file ({exc})") from None
    rollout = doc.get("rollout") if isinstance(doc, dict) else None
    sim = rollout.get("sim") if isinstance(rollout, dict) else None
    if not isinstance(rollout, dict) or not isinstance(sim, dict) or not sim:
        raise ValueError(f"profile {path} has no rollout.sim section (a mapping of engine costs)")
    # A profile is engine costs only: anything else in it (replicas, steps) would be ignored
    # silently by a plan that thinks it used it.
    others = [key for key in doc if key != "rollout"] + [f"rollout.{key}" for key in rollout if key != "sim"]
    if others:
        raise ValueError(f"profile {path}: only rollout.sim may be set, not {', '.join(others)}")
    try:  # here, to name the profile: checked with the config, a bad cost was the config file's
        SimEngineConfig.model_validate(sim)
    except ValidationError as exc:
        raise ValueError(f"profile {path}: {exc}") from None
    return sim


def write_profile(path: str | Path, sim: dict[str, Any], header: str) -> Path:
    """A profile file: ``header`` as comment lines, then ``rollout.sim``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    path.write_text(comment + yaml.safe_dump({"rollout": {"sim": sim}}, sort_keys=False))
    return path


__all__ = ["load_profile", "names", "write_profile"]
