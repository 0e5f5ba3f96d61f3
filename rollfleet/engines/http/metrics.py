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


def named_stats(metrics: dict[str, float], names: dict[str, str]) -> dict[str, float]:
    """{stat: the server's cumulative metric} for ``names`` (stat -> metric), with the prefix-cache
    hit rate when the query and hit token counts are among them."""
    out = {key: float(metrics.get(metric, 0.0)) for key, metric in names.items()}
    if "prefix_cache_query_tokens" in out:
        q = out["prefix_cache_query_tokens"]
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hit_tokens", 0.0) / q if q else 0.0
    return out


__all__ = ["metric_samples", "parse_metrics", "named_stats"]
