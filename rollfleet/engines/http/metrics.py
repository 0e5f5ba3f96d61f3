"""Prometheus text -> numbers, with ``prometheus_client``'s own parser (one parser for every engine).

Servers label their samples (model name, engine index, DP rank...); rollfleet wants one number per
metric. :func:`metric_samples` keeps every label set's value, :func:`parse_metrics` sums them
(counters and most gauges add up across engines/ranks; a caller that wants the largest, e.g. a
usage fraction per rank, takes ``max`` of the samples). Histogram buckets are skipped.
"""

from __future__ import annotations

from typing import Iterable, Optional


def _only(text: str, wanted: tuple[str, ...]) -> str:
    """The lines of ``text`` about ``wanted`` metrics. vLLM's page is ~1,000 lines of histograms and
    a load poll needs five metrics: filtering first makes a poll several times cheaper."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[2] in wanted:
                keep.append(line)
        elif line.startswith(wanted):
            cut = len(line.split("{", 1)[0].split(" ", 1)[0])
            if line[:cut] in wanted:
                keep.append(line)
    return "\n".join(keep) + "\n"


def metric_samples(text: str, names: Optional[Iterable[str]] = None) -> dict[str, list[float]]:
    """{sample name: [value of each label set]}; with ``names``, only those samples are parsed."""
    from prometheus_client.parser import text_string_to_metric_families

    if names is not None:
        text = _only(text, tuple(names))
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            out.setdefault(sample.name, []).append(float(sample.value))
    return out


def parse_metrics(text: str, names: Optional[Iterable[str]] = None) -> dict[str, float]:
    """{sample name: value summed over label sets}; with ``names``, only those samples."""
    return {name: sum(values) for name, values in metric_samples(text, names).items()}


__all__ = ["metric_samples", "parse_metrics"]
