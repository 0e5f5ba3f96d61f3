"""Run outputs: ``metrics.jsonl`` (one line per step), a timeline of what the trainer and the
fleet were doing, and the live progress line."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


class RunTracker:
    """Writes a run's metrics and timeline; times are seconds since it was made, on ``clock``
    (wall time by default; a virtual clock when the run is simulated)."""

    def __init__(self, run_dir: Path, resume: bool = False, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.timeline_path = self.run_dir / "timeline.jsonl"
        if not resume:
            for p in (self.metrics_path, self.timeline_path):
                p.unlink(missing_ok=True)
        self.t0 = clock()
        self.history: list[dict[str, Any]] = []

    def log(self, metrics: dict[str, Any]) -> None:
        row = {k: _jsonable(v) for k, v in metrics.items()}
        row.setdefault("time", self.clock() - self.t0)
        self.history.append(row)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def span_event(self, lane: str, kind: str, start: float, end: float, **info: Any) -> None:
        with open(self.timeline_path, "a") as f:
            f.write(
                json.dumps({"lane": lane, "kind": kind, "start": start - self.t0, "end": end - self.t0, **info}) + "\n"
            )

    @contextmanager
    def span(self, lane: str, kind: str, **info: Any) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.span_event(lane, kind, start, self.clock(), **info)


def _jsonable(v: Any) -> Any:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not Path(path).exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


__all__ = ["RunTracker", "read_jsonl"]
