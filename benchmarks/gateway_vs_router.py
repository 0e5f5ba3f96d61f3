"""rollfleet's gateway next to the router the peers deploy, in front of the same vLLM replicas.

Three ways to the same 2 vLLM CPU replicas of ``tiny``, measured from outside in one run, in
rounds that alternate the order (the machine's state drifts; alternating spreads it evenly):

* **direct**: the load generator picks the replica itself (session ``i`` -> replica ``i % 2``);
* **vllm-router** (``pip install vllm-router``, policy ``sticky_least_loaded``): a Rust router in
  its own process, sessions keyed by ``session_params.session_id``;
* **rollfleet gateway**: ``POST /v1/completions`` on the gateway (its own process, as
  ``rollfleet serve`` runs it), sticky by ``X-Session-ID``, recording nothing (completions).

Workload (issue 14's): 256 token-id completions of 32 tokens each (``ignore_eos``), 64 in flight,
32 sessions whose prompts share a 200-token prefix. Reported per way: median tokens/s over the
rounds and median p50, mean and p90 latency; how the requests split over the two replicas (from vLLM's own
``/metrics``: a sticky router that moves sessions shows here); and the CPU time the way's own
processes took per request (the router's process; the gateway's process and the replica actors),
also net of what those processes take in the other ways' rounds, serving nobody (health probes).
The load generator is a separate process (httpx), the same for all three; a request whose pooled
connection the server had just closed is sent once more (counted). Every process shares the
machine's cores with vLLM: on 2 cores that is the point.

Run: ``python benchmarks/gateway_vs_router.py [--rounds 6] [--max-num-seqs 128]`` (or ``python
benchmarks/gateway.py --engine vllm --vs vllm-router``); writes ``benchmarks/gateway_vs_router.json``
(``--out`` elsewhere), with the setup it ran under. ``--max-num-seqs`` bounds every server's batch:
vLLM then holds what exceeds it, in arrival order, whichever way the requests came.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import psutil
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import vllm_metrics

REQUESTS, TOKENS, IN_FLIGHT, SESSIONS, PREFIX = 256, 32, 64, 32, 200
OUT = Path(__file__).with_name("gateway_vs_router.json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _body(i: int, session: str, way: str) -> dict[str, Any]:
    prompt = [(7 * k) % 900 + 10 for k in range(PREFIX)] + [int(session[1:]) % 900 + 10, i % 900 + 10]
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True}
    if way == "vllm-router":
        body["session_params"] = {"session_id": session}
    return body


async def _load(way: str, urls: list[str]) -> dict[str, float]:
    import httpx

    latencies: list[float] = []
    tokens = 0
    sem = asyncio.Semaphore(IN_FLIGHT)
    limits = httpx.Limits(max_connections=IN_FLIGHT, max_keepalive_connections=IN_FLIGHT)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:

        async def one(i: int) -> None:
            nonlocal tokens
            s = i % SESSIONS
            session = f"s{s}"
            url = urls[s % len(urls)] if way == "direct" else urls[0]
            async with sem:
                started = time.monotonic()
                body, headers = _body(i, session, way), {"X-Session-ID": session}
                try:
                    resp = await http.post(f"{url}/v1/completions", json=body, headers=headers)
                except httpx.TransportError:  # a keep-alive connection closed under us: once more
                    resent[0] += 1
                    resp = await http.post(f"{url}/v1/completions", json=body, headers=headers)
                latencies.append(time.monotonic() - started)
            resp.raise_for_status()
            tokens += resp.json()["usage"]["completion_tokens"]

        resent = [0]
        started = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(REQUESTS)))
        wall = time.monotonic() - started
    latencies.sort()
    return {
        "tokens_per_s": tokens / wall, "p50_s": statistics.median(latencies), "mean_s": statistics.fmean(latencies),
        "p90_s": latencies[int(0.9 * (len(latencies) - 1))], "tokens": tokens, "resent": resent[0],
    }  # fmt: skip


def _loadgen(way: str, urls: list[str], queue: Any) -> None:
    queue.put(asyncio.run(_load(way, urls)))


def run_load(way: str, urls: list[str]) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_loadgen, args=(way, urls, queue), daemon=True)
    proc.start()
    deadline = time.monotonic() + 600
    while True:
        try:
            result = queue.get(timeout=1.0)
            break
        except queue_mod.Empty:  # still running, or dead without a result
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the {way} load generator ended without a result (exit {proc.exitcode})") from None
    proc.join(30)
    return result


def _served(urls: list[str]) -> list[float]:
    """Requests each replica has finished so far."""
    return [vllm_metrics.total(url, ["vllm:request_success_total"]) for url in urls]


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def measure(way: str, targets: list[str], replicas: list[str], groups: dict[str, list[int]]) -> dict[str, Any]:
    """One round of one way, with the split over the replicas and the CPU of each way's processes
    (all of them, every round: rollfleet's also work when they serve nobody, e.g. health probes)."""
    served0, cpu0 = _served(replicas), {g: _cpu_s(p) for g, p in groups.items()}
    res: dict[str, Any] = dict(run_load(way, targets))
    cpu, served1 = {g: _cpu_s(p) - cpu0[g] for g, p in groups.items()}, _served(replicas)
    res["split"] = [round(b - a) for a, b in zip(served0, served1)]
    res["cpu_ms_per_request"] = {g: c / REQUESTS * 1e3 for g, c in cpu.items()}
    res["path_cpu_ms_per_request"] = res["cpu_ms_per_request"].get(way, 0.0)
    return res


def _wait_http(url: str, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f}s")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=OUT, help="the JSON to write (default: the recorded run's)")
    parser.add_argument(
        "--max-num-seqs", type=int, default=128, help="each vLLM server's batch: fewer queue the rest inside vLLM"
    )
    args = parser.parse_args(argv)
    router_bin = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(router_bin).exists():
        sys.exit("vllm-router is not installed: pip install vllm-router")
    import ray

    ray.init(include_dashboard=False, num_cpus=3, log_to_driver=False)
    try:  # the gateway's loop is uvloop's, as under `rollfleet serve`
        import uvloop

        results = uvloop.run(_run(router_bin, args.rounds, Console(), args.max_num_seqs))
    finally:
        ray.shutdown()
    _report(results, Console(), args.out, {"max_num_seqs": args.max_num_seqs, "rounds": args.rounds})


async def _run(router_bin: str, rounds: int, console: Console, max_num_seqs: int) -> dict[str, list[dict[str, float]]]:
    from rollfleet.config import RollfleetConfig
    from rollfleet.manager import LLMServerManager

    config = RollfleetConfig.model_validate(
        {
            "rollout": {
                "name": "vllm",
                "model": "tiny",
                "num_replicas": 2,
                "prompt_length": 512,
                "response_length": TOKENS,
                "max_model_len": 1024,
                "vllm": {"max_num_seqs": max_num_seqs, "listen": "tcp"},  # vllm-router and direct call them too
            },
        }
    )
    manager = await LLMServerManager.create(config)
    router: Optional[asyncio.subprocess.Process] = None
    gateway: Any = None
    try:
        urls = [r.address for r in await manager.get_replicas()]
        router_port, gateway_port = _free_port(), _free_port()
        router = await asyncio.create_subprocess_exec(
            router_bin, "--host", "127.0.0.1", "--port", str(router_port), "--policy", "sticky_least_loaded",
            "--worker-urls", *urls, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        gateway = await _start_gateway(manager, gateway_port)
        ways = {
            "direct": urls,
            "vllm-router": [f"http://127.0.0.1:{router_port}"],
            "rollfleet gateway": [f"http://127.0.0.1:{gateway_port}"],
        }
        await asyncio.to_thread(_wait_http, f"http://127.0.0.1:{router_port}/health")
        actors = [
            p.pid for p in psutil.process_iter(["cmdline"]) if "ReplicaActor" in " ".join(p.info["cmdline"] or [])
        ]
        groups = {"vllm-router": [router.pid], "rollfleet gateway": [os.getpid(), *actors]}
        for way, targets in ways.items():  # warm-up: a round each (first forward passes are slow)
            await asyncio.to_thread(vllm_metrics.settle, urls)
            await asyncio.to_thread(run_load, way, targets)
        results: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
        order = list(ways)
        with Progress(console=console) as progress:
            task = progress.add_task("rounds", total=rounds * len(order))
            for r in range(rounds):
                for way in order[r % len(order) :] + order[: r % len(order)]:
                    await asyncio.to_thread(vllm_metrics.settle, urls)
                    res = await asyncio.to_thread(measure, way, ways[way], urls, groups)
                    results[way].append(res)
                    progress.console.print(
                        f"round {r + 1} {way}: {res['tokens_per_s']:.0f} tokens/s, p50 {res['p50_s']:.2f}s, "
                        f"mean {res['mean_s']:.2f}s, "
                        f"split {res['split']}, path CPU {res['path_cpu_ms_per_request']:.2f} ms/request"
                    )
                    progress.advance(task)
        return results
    finally:
        if gateway is not None:
            await gateway.stop()
        if router is not None:
            router.terminate()
            await router.wait()
        await manager.shutdown()


def _report(
    results: dict[str, list[dict[str, Any]]], console: Console, out: Path = OUT, setup: Optional[dict[str, Any]] = None
) -> None:
    table = Table(title=f"{REQUESTS} completions x {TOKENS} tokens, {IN_FLIGHT} in flight, {SESSIONS} sessions")
    for col in ("way", "tokens/s (median)", "latency p50 / mean / p90 (medians)", "rounds (tokens/s)",
                "split per round", "path CPU ms/request (less idle)"):  # fmt: skip
        table.add_column(col)
    summary: dict[str, Any] = {"setup": setup or {}}
    for way, rows in results.items():
        tps = statistics.median(r["tokens_per_s"] for r in rows)
        p50 = statistics.median(r["p50_s"] for r in rows)
        mean_s, p90 = (statistics.median(r[k] for r in rows) for k in ("mean_s", "p90_s"))
        cpu = statistics.median(r["path_cpu_ms_per_request"] for r in rows)
        idle = [r["cpu_ms_per_request"].get(way, 0.0) for w, rs in results.items() if w != way for r in rs]
        net = cpu - statistics.median(idle) if idle else cpu  # less what the processes do serving nobody
        summary[way] = {"tokens_per_s": tps, "p50_s": p50, "mean_s": mean_s, "p90_s": p90, "path_cpu_ms_per_request": cpu,
                        "path_cpu_net_ms_per_request": net, "rounds": rows}  # fmt: skip
        table.add_row(
            way, f"{tps:,.0f}", f"{p50:.2f} / {mean_s:.2f} / {p90:.2f} s", ", ".join(f"{r['tokens_per_s']:.0f}" for r in rows),
            " ".join("/".join(str(n) for n in r["split"]) for r in rows), f"{cpu:.2f} ({net:.2f} net)",
        )  # fmt: skip
    console.print(table)
    # Rounds of one way vary 2-3x on 2 shared cores; the ways' rounds run back to back, so each
    # round's ratio (same minute, same machine state) says more than the ratio of the medians.
    for a, b in (("rollfleet gateway", "vllm-router"), ("rollfleet gateway", "direct")):
        if a in results and b in results:
            pairs = list(zip(results[a], results[b]))
            tps = sorted(x["tokens_per_s"] / y["tokens_per_s"] for x, y in pairs)
            p50 = sorted(x["p50_s"] / y["p50_s"] for x, y in pairs)
            # At a fixed number in flight the mean latency is set by throughput (Little's law): where
            # tokens/s match, the mean does too, and a lower p50 is a different spread, not a faster path.
            means = sorted(x["mean_s"] / y["mean_s"] for x, y in pairs)
            won = sum(x["tokens_per_s"] >= y["tokens_per_s"] for x, y in pairs)
            summary[f"{a} / {b}"] = {"tokens_per_s_ratio_median": statistics.median(tps), "tokens_per_s_ratios": tps,
                                     "p50_ratio_median": statistics.median(p50), "p50_ratios": p50,
                                     "mean_latency_ratio_median": statistics.median(means),
                                     "rounds_at_least_as_fast": won, "rounds": len(pairs)}  # fmt: skip
            console.print(
                f"{a} / {b}, round by round: tokens/s x{statistics.median(tps):.3f} median "
                f"({tps[0]:.2f}-{tps[-1]:.2f}), p50 x{statistics.median(p50):.3f} median, "
                f"mean latency x{statistics.median(means):.3f} median; "
                f"at least as fast in {won} of {len(pairs)} rounds"
            )
    out.write_text(json.dumps(summary, indent=2))


async def _start_gateway(manager: Any, port: int) -> Any:
    """The gateway in this process on the fleet's client (the load comes from another process)."""
    from rollfleet.client import FullyAsyncLLMServerClient
    from rollfleet.config import GatewayConfig
    from rollfleet.gateway import Gateway, GatewayServer, TextCodec

    client = manager.get_client(FullyAsyncLLMServerClient)
    gateway = Gateway(client, TextCodec.load("tiny"), config=GatewayConfig(port=port), rollout=client.config)
    return await GatewayServer(gateway.app, port=port).start()


if __name__ == "__main__":
    main()
