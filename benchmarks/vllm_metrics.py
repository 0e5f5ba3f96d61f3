"""Reading vLLM's own ``/metrics`` from the outside, shared by the benchmarks that run next to real
vLLM replicas (``gateway_vs_router.py``, ``routing_vllm.py``): what a replica counts is the ground
truth a benchmark compares its own client-side numbers with."""

from __future__ import annotations

import time
from typing import Iterable


def read(url: str, names: Iterable[str]) -> dict[str, float]:
    """The series ``names`` from one read of the replica's ``/metrics`` (each summed over its labels;
    a name the replica does not export is left out)."""
    import httpx

    from rollfleet.engines.http.metrics import parse_metrics

    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text, list(names))


def total(url: str, names: Iterable[str]) -> float:
    """The sum of ``names`` in one replica's ``/metrics``."""
    return sum(read(url, names).values())


def settle(urls: list[str], quiet_s: float = 2.5, timeout_s: float = 60.0) -> None:
    """Wait until no replica runs or queues a request, then ``quiet_s`` more: long enough for a
    router's or gateway's load reports (polled every second) to stop showing the previous round's
    requests, which would otherwise count as another client's load when the next round's are placed."""
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(total(url, names) for url in urls) == 0:
            break
        time.sleep(0.2)
    time.sleep(quiet_s)
