"""Faults while a fleet generates: what is lost, duplicated or truncated, and how long it takes to
notice and recover, one scenario after the other on a simulated fleet (Ray, 4 sim replicas), and on
real vLLM where marked.

Each scenario starts a fresh fleet and runs a rollout of ``--requests`` generations, ``--concurrency``
at a time, each with a budget drawn up to ``--budget`` tokens (``ignore_eos``, through the resuming
client, so every one must come back with exactly its budget); the fault comes ``--fault-at`` seconds
in:

* ``replica SIGKILL``: the replica actor's process is killed;
* ``replica hang``: its engine stops answering (its process lives on);
* ``replica SIGSTOP + update``: the actor's process is stopped, then a weight update is pushed;
* ``update storm``: an abort-mode weight update every 0.3 s for the whole rollout;
* ``cancellation storm``: ``--cancel`` requests, each cancelled at a random moment;
* ``sessions``: ``--sessions`` concurrent short sessions;
* ``node removal``: the fleet is placed on two fresh nodes of a real multi-node Ray cluster (this
  benchmark runs on a ``ray.cluster_utils.Cluster``: a head and worker nodes on this machine, each a
  raylet of its own): 2 replicas on a node with 2 (fake) GPUs, 2 on one with 4; the first node is
  removed (its raylet and every process on it killed), and its replicas restart on the free GPUs;
* ``vLLM SIGKILL`` (``--vllm``; not in the default list): 2 vLLM CPU replicas of the ``tiny``
  model; one's vLLM server process is killed (the replica lives and restarts it).

Reported per scenario: requests lost (an error reached the caller), duplicated (more tokens than the
budget) and truncated (fewer), the in-flight count left over, the time to detect the fault (the
controller marks the replica dead), to recover (it serves again), how long the weight update took,
and the fleet-frozen time: the longest stretch with no generation finishing anywhere (the whole
fleet, not the faulty replica). With several victims (a node), detect is the first one marked dead
and recover the last one serving again.

Run: ``python benchmarks/faults.py`` (about 4 minutes on 2 cores; ``--vllm`` adds about 3 more);
``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from dataclasses import asdict
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from fault_rollout import VICTIM, Outcome, fleet_config, rollout

from rollfleet.client import FullyAsyncLLMServerClient
from rollfleet.manager import LLMServerManager
from rollfleet.manager.ray_runtime import use_loopback

#: The Ray cluster every scenario runs on (started in main); node removal adds nodes to it.
CLUSTER: Any = None


async def victim_pid(manager: LLMServerManager) -> int:
    return int((await manager.replica_stats())[VICTIM]["pid"])


async def scenario(args: argparse.Namespace, name: str) -> Outcome:
    if name == "node removal":
        return await node_removal(args)
    if name == "vLLM SIGKILL":
        return await vllm_sigkill(args)
    manager = await LLMServerManager.create(fleet_config(args))
    try:
        if name == "replica SIGKILL":

            async def kill(out: Outcome, at: float) -> None:
                os.kill(await victim_pid(manager), signal.SIGKILL)
                return None

            return await rollout(manager, args, name, kill)
        if name == "replica hang":

            async def hang(out: Outcome, at: float) -> None:
                await manager.inject_fault(VICTIM, "hang")
                return None

            return await rollout(manager, args, name, hang)
        if name == "replica SIGSTOP + update":
            pid = await victim_pid(manager)

            async def stop_and_update(out: Outcome, at: float) -> None:
                os.kill(pid, signal.SIGSTOP)
                began = time.monotonic()
                version = (await manager.status()).current_version + 1
                await manager.update_weights({"step": version}, version)
                out.update_s = time.monotonic() - began
                out.updates = 1
                return None

            try:
                return await rollout(manager, args, name, stop_and_update)
            finally:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        if name == "update storm":

            async def storm(out: Outcome, at: float) -> asyncio.Task[None]:
                async def loop() -> None:
                    version = (await manager.status()).current_version
                    while True:
                        await asyncio.sleep(0.3)
                        version += 1
                        began = time.monotonic()
                        await manager.update_weights({"step": version}, version, "abort")
                        out.update_s = max(out.update_s or 0.0, time.monotonic() - began)
                        out.updates += 1

                return asyncio.ensure_future(loop())

            return await rollout(manager, args, name, storm, watch=False)
        if name == "cancellation storm":
            return await cancellations(manager, args)
        if name == "sessions":
            return await sessions(manager, args)
        raise ValueError(name)
    finally:
        await manager.shutdown()


async def node_removal(args: argparse.Namespace) -> Outcome:
    """Two fresh nodes labelled for the fleet: 2 GPUs (the one that dies) and 4 (room for its
    replicas once it is gone); replicas SPREAD over them, so each hosts two."""
    node = {"node_ip_address": "127.0.0.1", "labels": {"pool": "faults"}}
    doomed = CLUSTER.add_node(num_cpus=2, num_gpus=2, **node)
    spare = CLUSTER.add_node(num_cpus=4, num_gpus=4, **node)
    await asyncio.to_thread(CLUSTER.wait_for_nodes)
    placement = {"device": "gpu", "strategy": "SPREAD", "node_labels": {"pool": "faults"}, "pending_retry_s": 0.5}
    manager = await LLMServerManager.create(fleet_config(args, placement=placement))
    try:
        victims = tuple(r.replica_id for r in await manager.get_replicas() if r.node_id == doomed.node_id)
        assert victims, "SPREAD put no replica on the node to remove"

        async def remove(out: Outcome, at: float) -> None:
            await asyncio.to_thread(CLUSTER.remove_node, doomed)

        return await rollout(manager, args, "node removal", remove, victims=victims)
    finally:
        await manager.shutdown()
        await asyncio.to_thread(CLUSTER.remove_node, spare)


async def vllm_sigkill(args: argparse.Namespace) -> Outcome:
    """2 vLLM CPU replicas of ``tiny``; one's vLLM server is SIGKILLed (its replica restarts it)."""
    config = fleet_config(
        args,
        name="vllm",
        model="tiny",
        num_replicas=2,
        prompt_length=16,
        response_length=args.vllm_budget,
        max_model_len=512,
        health={"probe_interval_s": 0.5, "probe_timeout_s": 5.0, "failures_to_dead": 2, "restart_backoff_s": 0.5},
        vllm={"max_num_seqs": 64},
    )
    manager = await LLMServerManager.create(config)
    try:
        vllm_args = argparse.Namespace(**{**vars(args), "requests": args.vllm_requests, "budget": args.vllm_budget})

        async def kill(out: Outcome, at: float) -> None:
            os.kill(int((await manager.replica_stats())[VICTIM]["vllm_pid"]), signal.SIGKILL)

        return await rollout(manager, vllm_args, "vLLM SIGKILL", kill)
    finally:
        await manager.shutdown()


def start_cluster(num_cpus: int) -> None:
    """A multi-node Ray cluster on this machine (Ray's own test harness); its head hosts everything
    but the fleet of ``node removal``."""
    global CLUSTER
    import ray
    from ray.cluster_utils import Cluster

    use_loopback()
    CLUSTER = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": num_cpus,
            "num_gpus": 0,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    ray.init(address=CLUSTER.address, namespace="rollfleet-faults", log_to_driver=False)


async def cancellations(manager: LLMServerManager, args: argparse.Namespace) -> Outcome:
    out = Outcome("cancellation storm", requests=args.cancel)
    client = manager.get_client(FullyAsyncLLMServerClient)
    rng = random.Random(0)
    started = time.monotonic()
    tasks = [
        asyncio.ensure_future(
            client.generate(f"c{i}", prompt_ids=[3, 4, 5], sampling_params={"max_tokens": 64, "ignore_eos": True})
        )
        for i in range(args.cancel)
    ]
    for task in tasks:
        asyncio.get_running_loop().call_later(rng.uniform(0, 2.0), task.cancel)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    out.lost = sum(isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError) for r in results)
    out.cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
    out.wall_s = time.monotonic() - started
    await asyncio.sleep(1.0)  # replicas see the cancels
    stats = await manager.status()
    out.inflight_left = client.balancer.get_total_inflight() + sum(r.inflight or 0 for r in stats.replicas.values())
    return out


async def sessions(manager: LLMServerManager, args: argparse.Namespace) -> Outcome:
    out = Outcome("sessions", requests=args.sessions)
    client = manager.get_client(FullyAsyncLLMServerClient)
    started = time.monotonic()

    async def one(i: int) -> None:
        try:
            o = await client.generate(
                f"s{i}", prompt_ids=[3, 4, 5 + i % 1000], sampling_params={"max_tokens": 8, "ignore_eos": True}
            )
            out.truncated += len(o.token_ids) < 8
            out.duplicated += len(o.token_ids) > 8
        except Exception:
            out.lost += 1
        finally:
            client.finish_session(f"s{i}")

    await asyncio.gather(*(one(i) for i in range(args.sessions)))
    out.wall_s = time.monotonic() - started
    out.inflight_left = client.balancer.get_total_inflight()
    return out


SCENARIOS = (
    "replica SIGKILL",
    "replica hang",
    "replica SIGSTOP + update",
    "update storm",
    "cancellation storm",
    "sessions",
    "node removal",
)
#: Scenarios on real vLLM, run with ``--vllm``.
VLLM_SCENARIOS = ("vLLM SIGKILL",)


def fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


async def main_async(args: argparse.Namespace) -> list[Outcome]:
    console = Console(width=160)
    outcomes = []
    for name in args.scenarios or (SCENARIOS + (VLLM_SCENARIOS if args.vllm else ())):
        console.print(f"[bold]{name}[/bold] ...")
        outcome = await scenario(args, name)
        console.print(f"  {asdict(outcome)}")
        outcomes.append(outcome)
    title = (
        f"faults on 4 sim replicas ({args.requests} generations of <= {args.budget} tokens, {args.concurrency} at once;"
        f" vLLM: 2 replicas, {args.vllm_requests} of <= {args.vllm_budget})"
    )
    table = Table(title=title)
    for col in ("scenario", "replicas hit", "requests", "lost", "dup.", "trunc.", "cancelled", "in flight after", "detect s",
                "recover s", "updates", "longest update s", "fleet frozen s", "wall s"):  # fmt: skip
        table.add_column(col, justify="right" if col != "scenario" else "left")
    for o in outcomes:
        table.add_row(
            o.scenario, str(o.victims or "-"), str(o.requests), str(o.lost), str(o.duplicated), str(o.truncated), str(o.cancelled),
            str(o.inflight_left), fmt(o.detect_s), fmt(o.recover_s), str(o.updates), fmt(o.update_s),
            fmt(o.frozen_s), fmt(o.wall_s),
        )  # fmt: skip
    console.print(table)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--budget", type=int, default=300)
    parser.add_argument("--fault-at", type=float, default=2.0, help="seconds into the rollout")
    parser.add_argument("--cancel", type=int, default=5000)
    parser.add_argument("--sessions", type=int, default=10000)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--scenarios", nargs="*", choices=SCENARIOS + VLLM_SCENARIOS)
    parser.add_argument("--vllm", action="store_true", help="also run the scenarios on real vLLM")
    parser.add_argument("--vllm-requests", type=int, default=200)
    parser.add_argument("--vllm-budget", type=int, default=128)
    parser.add_argument("--json", help="write the outcomes here")
    args = parser.parse_args()
    start_cluster(num_cpus=8)  # once for every scenario's fleet
    outcomes = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(o) for o in outcomes], f, indent=2)


if __name__ == "__main__":
    main()
