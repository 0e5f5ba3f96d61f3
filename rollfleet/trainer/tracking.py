"""Run outputs: ``metrics.jsonl`` (one line per step), a timeline of what the trainer and the
fleet were doing, and the live progress line."""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

logger = logging.getLogger(__name__)


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

    def resume_at(self, step: int) -> None:
        """Go on from a checkpoint taken after ``step`` (0: none): what the run before logged past it
        is dropped, since those steps run again, and times go on from the last row kept (appended
        as it was, a resumed run's rows repeated steps and its spans started at 0 over the old)."""
        rows = [r for r in read_jsonl(self.metrics_path) if r.get("step", 0) <= step]
        last = rows[-1].get("time", 0.0) if rows else 0.0
        spans = [s for s in read_jsonl(self.timeline_path) if s.get("end", 0.0) <= last] if rows else []
        for path, lines in ((self.metrics_path, rows), (self.timeline_path, spans)):
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        self.history = rows
        self.t0 = self.clock() - last

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
    """The rows of a JSON-lines file. A last line that does not parse is one a crash cut off
    while it was written (what ``--resume`` is for): it is left out, with a warning. Any other
    line that does not parse is an error naming the file and the line."""
    if not Path(path).exists():
        return []
    with open(path) as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    rows = []
    for i, line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == lines[-1][0]:
                logger.warning("%s: its last line (%d) was cut off (%s): left out", path, i, exc)
                break
            raise ValueError(f"{path}: line {i} is not JSON ({exc})") from None
    return rows


__all__ = ["RunTracker", "read_jsonl"]
