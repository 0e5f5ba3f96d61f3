"""Gateway overhead: requests through the HTTP gateway vs the same requests through the client.

One simulated fleet (2 replicas, time scale 1e5, ``max_tokens`` 4, so the engine is never the
bottleneck), three ways in:

* **client** — ``FullyAsyncLLMServerClient.generate`` called in-process: the floor, what an agent
  loop pays without HTTP (routing + one request over the replica's data plane);
* **gateway** — ``POST /v1/completions/tokens`` (token ids in and out, the RL hot path) and
  ``POST /v1/chat/completions`` (chat template + decoding) through the gateway, served by uvicorn
  in this process on the same client; the load comes from a *separate* process (a minimal
  keep-alive HTTP/1.1 client on raw sockets, so the load generator neither shares the gateway's
  GIL nor costs as much as an httpx client would);
* **gateway, null fleet** — the same gateway over a client that answers at once without Ray: the
  gateway process's own ceiling (HTTP parsing, validation, JSON, metrics).

For each: requests/s at ``--concurrency`` concurrent connections, p50/p99 latency of sequential
requests (concurrency 1), and CPU time of *this* process per request (the gateway's process in the
HTTP rows; the difference to the client row is what the gateway itself costs). Everything shares
the machine's cores: on 2 cores the Ray replicas, the load generator and the gateway compete.

Run: ``python benchmarks/gateway.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from rollfleet.client import FullyAsyncLLMServerClient, LLMServerClient
from rollfleet.config import GatewayConfig, RollfleetConfig
from rollfleet.gateway import Gateway, GatewayServer, TextCodec, fit_sim_to_tokenizer
from rollfleet.gateway.jsonio import BACKEND as JSON_BACKEND
from rollfleet.types import TokenOutput

MODEL = "tiny"
PROMPT_IDS = [17, 42, 99, 123, 256, 300, 301, 302]
MAX_TOKENS = 4


@dataclass
class Result:
    name: str
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us: float  # CPU time of this process per request at the throughput concurrency


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# ---------------------------------------------------------------------- load generator (own process)
def _request_bytes(path: str, body: dict[str, Any], port: int) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


async def _conn_loop(port: int, request: bytes, n: int, latencies: list[float], errors: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(n):
            start = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            status = int(head[9:12])
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - start)
            if status != 200:
                errors.append(status)
    finally:
        writer.close()


async def _load(
    port: int, path: str, body: dict[str, Any], concurrency: int, total: int
) -> tuple[float, list[float], list[int]]:
    request = _request_bytes(path, body, port)
    latencies: list[float] = []
    errors: list[int] = []
    per = max(1, total // concurrency)
    start = time.perf_counter()
    await asyncio.gather(*(_conn_loop(port, request, per, latencies, errors) for _ in range(concurrency)))
    return time.perf_counter() - start, latencies, errors


def _loadgen_main(port: int, path: str, body: dict[str, Any], concurrency: int, total: int, out: Any) -> None:
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover
        run = asyncio.run
    out.send(run(_load(port, path, body, concurrency, total)))
    out.close()


async def run_loadgen(
    port: int, path: str, body: dict[str, Any], concurrency: int, total: int
) -> tuple[float, list[float], list[int], float]:
    """Run the load in a child process; return (wall s, latencies, error statuses, our CPU s)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_loadgen_main, args=(port, path, body, concurrency, total, child), daemon=True)
    proc.start()
    child.close()
    cpu0 = time.process_time()
    loop = asyncio.get_running_loop()
    while not parent.poll():
        await asyncio.sleep(0.01)
    cpu = time.process_time() - cpu0
    wall, lat, errors = parent.recv()
    await loop.run_in_executor(None, proc.join)
    return wall, lat, errors, cpu


# ---------------------------------------------------------------------- the three paths
async def bench_client(client: LLMServerClient, concurrency: int, total: int, sequential: int) -> Result:
    params = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    lat: list[float] = []
    for i in range(sequential):
        start = time.perf_counter()
        await client.generate(f"seq-{i}", prompt_ids=PROMPT_IDS, sampling_params=params)
        lat.append(time.perf_counter() - start)
        client.finish_session(f"seq-{i}")

    async def worker(k: int, n: int) -> None:
        for j in range(n):
            rid = f"c{k}-{j}"
            await client.generate(rid, prompt_ids=PROMPT_IDS, sampling_params=params)
            client.finish_session(rid)

    per = max(1, total // concurrency)
    cpu0, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(k, per) for k in range(concurrency)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    n = per * concurrency
    return Result("client (in-process)", n / wall, _pct(lat, 0.5) * 1e3, _pct(lat, 0.99) * 1e3, cpu / n * 1e6)


async def bench_http(
    name: str, port: int, path: str, body: dict[str, Any], concurrency: int, total: int, sequential: int
) -> Result:
    _, seq_lat, errors, _ = await run_loadgen(port, path, body, 1, sequential)
    wall, lat, errors2, cpu = await run_loadgen(port, path, body, concurrency, total)
    if errors or errors2:
        raise RuntimeError(f"{name}: {len(errors) + len(errors2)} requests failed, e.g. HTTP {(errors + errors2)[0]}")
    return Result(name, len(lat) / wall, _pct(seq_lat, 0.5) * 1e3, _pct(seq_lat, 0.99) * 1e3, cpu / len(lat) * 1e6)


class NullClient(LLMServerClient):
    """Answers at once with MAX_TOKENS tokens: no Ray, no replica (the gateway's own ceiling)."""

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: Any = None, **kwargs: Any
    ) -> TokenOutput:
        n = (sampling_params or {}).get("max_tokens", MAX_TOKENS)
        return TokenOutput(
            token_ids=[5] * n,
            log_probs=[-0.5] * n,
            stop_reason="length",
            token_versions=[0] * n,
            extra_fields={"replica_id": "null", "min_global_steps": 0, "max_global_steps": 0, "num_resumes": 0},
        )


async def capture_cost(codec: TextCodec, rollout: Any, sessions: int = 200, turns: int = 3) -> dict[str, float]:
    """CPU of this process per chat request, with and without trajectory capture (``sessions`` x
    ``turns``, each turn extending the last), on the null fleet over in-process ASGI: the
    difference is what recording a session's turns costs the gateway."""
    import httpx

    out = {}
    for capture in (False, True):
        gateway = Gateway(
            NullClient(rollout, servers={}), codec, config=GatewayConfig(capture_trajectories=capture), rollout=rollout
        )
        transport = httpx.ASGITransport(app=gateway.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            cpu0 = time.process_time()
            for i in range(sessions):
                messages: list[dict[str, Any]] = []
                for t in range(turns):
                    messages.append({"role": "user", "content": f"session {i} turn {t}: 1 2 3"})
                    resp = await http.post(
                        f"/sessions/s{i}/v1/chat/completions",
                        json={"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS},
                    )
                    resp.raise_for_status()
                    messages.append(resp.json()["choices"][0]["message"])
            out["on" if capture else "off"] = (time.process_time() - cpu0) / (sessions * turns) * 1e6
        if capture:
            assert len(gateway.trajectories) == sessions
    return out


# ---------------------------------------------------------------------- main
async def main_async(args: argparse.Namespace, console: Console) -> list[Result]:
    from rollfleet.manager import LLMServerManager

    codec = TextCodec.load(MODEL)
    config = RollfleetConfig.model_validate(
        {
            "rollout": {
                "name": "sim",
                "model": MODEL,
                "num_replicas": args.replicas,
                "prompt_length": 64,
                "max_model_len": 512,
                "response_length": MAX_TOKENS,
                "sim": {"time_scale": 1e5},
                "data_plane": args.data_plane,
            },
            "ray": {"num_cpus": 2},
            "gateway": {"port": 0},
        }
    )
    config = fit_sim_to_tokenizer(config, codec)
    manager = await LLMServerManager.create(config)
    results: list[Result] = []
    try:
        client = manager.get_client(FullyAsyncLLMServerClient)
        gateway = Gateway(client, codec, config=config.gateway, rollout=config.rollout)
        server = await GatewayServer(gateway.app).start()
        null_gateway = Gateway(
            NullClient(config.rollout, servers={}), codec, config=GatewayConfig(), rollout=config.rollout
        )
        null_server = await GatewayServer(null_gateway.app).start()
        try:
            tokens_body = {"model": MODEL, "prompt_token_ids": PROMPT_IDS, "max_tokens": MAX_TOKENS, "ignore_eos": True}
            chat_body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
            }
            conc, total, seq = args.concurrency, args.requests, args.sequential
            # warm-up: Ray connections, the fleet view, uvicorn, the load generator's imports
            await bench_client(client, 8, 200, 20)
            await bench_http("warm-up", server.port, "/v1/completions/tokens", tokens_body, 8, 200, 20)
            console.print("[dim]measuring the client path...[/]")
            results.append(await bench_client(client, conc, total, seq))
            console.print("[dim]measuring the gateway (token route)...[/]")
            results.append(
                await bench_http(
                    "gateway /v1/completions/tokens",
                    server.port,
                    "/v1/completions/tokens",
                    tokens_body,
                    conc,
                    total,
                    seq,
                )
            )
            console.print("[dim]measuring the gateway (chat route)...[/]")
            results.append(
                await bench_http(
                    "gateway /v1/chat/completions", server.port, "/v1/chat/completions", chat_body, conc, total, seq
                )
            )
            console.print("[dim]measuring the gateway over a null fleet...[/]")
            results.append(
                await bench_http(
                    "gateway tokens, null fleet",
                    null_server.port,
                    "/v1/completions/tokens",
                    tokens_body,
                    conc,
                    total,
                    seq,
                )
            )
            console.print("[dim]measuring trajectory capture...[/]")
            cost = await capture_cost(codec, config.rollout)
            console.print(
                f"chat, {MAX_TOKENS}-token replies, 3-turn sessions (in-process, null fleet): "
                f"{cost['off']:,.0f} µs of CPU per request without capture, {cost['on']:,.0f} µs with it "
                f"(capture costs {cost['on'] - cost['off']:+,.0f} µs per request)"
            )
        finally:
            await null_server.stop()
            await server.stop()
    finally:
        await manager.shutdown()
    return results


def render(results: list[Result], args: argparse.Namespace, console: Console) -> None:
    base = results[0]
    table = Table(
        title=f"gateway vs client: sim fleet of {args.replicas} ({args.data_plane} data plane), max_tokens {MAX_TOKENS}, "
        f"{args.concurrency} concurrent, {os.cpu_count()} cores, JSON: {JSON_BACKEND}"
    )
    for col in (
        "path",
        "requests/s",
        "vs client",
        "p50 ms (seq)",
        "added p50 ms",
        "p99 ms (seq)",
        "CPU µs/req (this process)",
    ):
        table.add_column(col, justify="left" if col == "path" else "right")
    for r in results:
        table.add_row(
            r.name,
            f"{r.rps:,.0f}",
            f"{r.rps / base.rps:.2f}x",
            f"{r.p50_ms:.2f}",
            "" if r is base else f"{r.p50_ms - base.p50_ms:+.2f}",
            f"{r.p99_ms:.2f}",
            f"{r.cpu_us:,.0f}",
        )
    console.print(table)
    tok = results[1]
    console.print(
        f"token route: {tok.rps:,.0f} req/s through one gateway process (target >= 1,000), "
        f"added p50 {tok.p50_ms - base.p50_ms:+.2f} ms (target < 2 ms); "
        f"gateway-only ceiling (null fleet): {results[-1].rps:,.0f} req/s"
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=6400, help="per throughput measurement")
    parser.add_argument("--sequential", type=int, default=400, help="sequential requests for the latency columns")
    parser.add_argument(
        "--data-plane",
        choices=["direct", "ray"],
        default="direct",
        help="how requests reach the replicas (ray: verl's way)",
    )
    parser.add_argument(
        "--engine", choices=["sim", "vllm"], default="sim", help="vllm: the gateway next to vllm-router (see --vs)"
    )
    parser.add_argument("--vs", choices=["vllm-router"], default="vllm-router", help="with --engine vllm")
    parser.add_argument("--rounds", type=int, default=6, help="with --engine vllm: rounds of each way")
    args = parser.parse_args(argv)
    if args.engine == "vllm":  # real engines, another benchmark: benchmarks/gateway_vs_router.py
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gateway_vs_router

        gateway_vs_router.main(["--rounds", str(args.rounds)])
        return 0
    console = Console(width=max(150, Console().width))
    try:
        import uvloop

        results = uvloop.run(main_async(args, console))
    except ImportError:  # pragma: no cover
        results = asyncio.run(main_async(args, console))
    render(results, args, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
